# Measurement only (evaluation data, never trained on): each head's top-1 as the engine runs it (head/as_run.py) over
# the target's own greedy answers to Spec-Bench prompts, by category. The held-back split of a head's training says how
# well it learnt its own kind of text; this says how well that carries to what the bench asks.
# Run from the repository: python docs/bench/head-everyday-zen5/bench_top1.py PER_CATEGORY MAX_TOKENS HEAD_DIR ...
# (the answers and their features are kept in /tmp/diag, so later heads are scored on the same text)
import sys, collections, time, os
import torch
from draftwise.loading import load_models
from draftwise.backends.kernels import on_timed_kernels
from draftwise.bench.prompts import default_prompts, select_prompts
from draftwise.head.answers import target_answers
from draftwise.head.features import target_features
from draftwise.head.as_run import top1_as_run
from draftwise.head.corpus import Piece
PER = int(sys.argv[1]); TOKENS = int(sys.argv[2]); heads = sys.argv[3:]
target, tok, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
fast = on_timed_kernels(target)
prompts = select_prompts(default_prompts(), per_category=PER)
os.makedirs("/tmp/diag", exist_ok=True)
cache = f"/tmp/diag/bench_answers_{PER}_{TOKENS}.pt"
if os.path.exists(cache):
    seqs = torch.load(cache)
else:
    t = time.time()
    reqs = [(p.category, [{"role": "user", "content": p.text}]) for p in prompts]
    pieces = target_answers(fast, tok, reqs, TOKENS, progress=False)
    print(f"answers {time.time()-t:.0f} s", flush=True)
    seqs = []
    for piece in pieces:
        f, nxt = target_features(fast, piece.ids)
        seqs.append({"ids": torch.tensor(piece.ids), "features": f, "next": nxt.long(), "answer_start": piece.answer_start, "category": piece.source})
    torch.save(seqs, cache)
    print(f"features done {time.time()-t:.0f} s", flush=True)
for h in heads:
    by = collections.defaultdict(list)
    for s in seqs: by[s["category"]].append(s)
    line = []
    tot_h = tot_n = 0
    for c, ss in by.items():
        r = top1_as_run(target, os.path.expanduser(h), ss, progress=False)
        line.append(f"{c} {100*r['top1']:.1f}%")
        tot_h += r["top1"] * r["tokens"]; tot_n += r["tokens"]
    print(h, f"all {100*tot_h/tot_n:.1f}% of {tot_n}:", ", ".join(line), flush=True)
