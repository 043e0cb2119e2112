# The long held-back requests of online_k1.py: 24 requests over 3,000-5,000-character excerpts of package files
# that train-head holds back (train._held_back), answered greedily by the target (128 tokens), with its features.
# Writes /tmp/longctx/pieces.json and /tmp/longctx/features.
"""Long-context held-back eval set for the head: requests over 3,000-5,000-char excerpts of held-back package files
(never Spec-Bench), answered greedily by the target; features collected."""
import json, random, sys
from pathlib import Path
import torch
from draftwise.loading import load_models
from draftwise.head.corpus import corpus_texts, package_roots, Piece
from draftwise.head.train import _held_back
from draftwise.head.answers import target_answers
from draftwise.head.features import collect
from draftwise.backends.kernels import on_timed_kernels

OUT = Path("/tmp/longctx"); COUNT = int(sys.argv[1]) if len(sys.argv) > 1 else 24
KINDS = ("Summarize the following text in a short paragraph.\n\n{text}",
         "Read the following document, then answer: what does it describe, and what are its main parts?\n\n{text}",
         "{text}\n\nWrite a brief summary of the text above.")
rng = random.Random(1)
requests = []
for label, text in corpus_texts(package_roots()):
    if len(requests) >= COUNT: break
    if not _held_back(label) or len(text) < 3500 or not label.endswith((".md", ".rst", ".txt")) and rng.random() < 0.6:
        continue
    size = rng.randrange(3000, 5000)
    start = rng.randrange(max(1, len(text) - size))
    requests.append((label, [{"role": "user", "content": rng.choice(KINDS).format(text=text[start:start+size].strip())}]))
print(len(requests), "requests", [l for l, _ in requests])
m, tok, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
running = on_timed_kernels(m)
pieces = target_answers(running, tok, requests, 128, batch_size=8)
(OUT / "pieces.json").write_text(json.dumps([p.__dict__ for p in pieces]))
print("lengths", [len(p.ids) for p in pieces], "answer_start", [p.answer_start for p in pieces])
collect(running, [p.ids for p in pieces], OUT / "features", True)
