"""Greedy `draft`: adaptive k against fixed k = 2 and 3 and `none`, on prompts written for this record (ordinary
writing, questions, and answers from a document: two of the project's own docs pages as the document):

    .venv/bin/python docs/experiments/tools/adaptive_vs_fixed.py

Per prompt and arm: decode ms a token, draft tokens kept over offered, rounds, and rounds that drafted."""
from __future__ import annotations

from draftwise import Engine
DOC = open("docs/serving.md").read()[:6000]
DOC2 = open("docs/architecture.md").read()[:6000]
PROMPTS = [
    ("write", "Write a short essay on how public libraries changed in the last thirty years."),
    ("write", "Write a letter to a friend describing a weekend hiking trip in the mountains."),
    ("qa", "Why do leaves change colour in autumn?"),
    ("qa", "What is the difference between weather and climate?"),
    ("doc", "Here is a document:\n\n" + DOC + "\n\nBased on the document, explain how the server handles a bad request."),
    ("doc", "Here is a document:\n\n" + DOC2 + "\n\nSummarize the layers described in this document."),
]
eng = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", method="draft",
                             backend="quant", progress=False)
eng.generate("def f(x):", max_new_tokens=8)
arms = [("none", dict(method="none")), ("adaptive", dict(method="draft")),
        ("k2", dict(method="draft", adaptive=False, num_draft_tokens=2)),
        ("k3", dict(method="draft", adaptive=False, num_draft_tokens=3))]
tot = {a: [0.0, 0, 0, 0, 0] for a, _ in arms}
for kind, p in PROMPTS:
    line = kind
    for name, opt in arms:
        r = eng.generate([{"role": "user", "content": p}], chat=True, max_new_tokens=128, ignore_eos=True, **opt)
        s = r.stats
        t = tot[name]; t[0] += s.decode_s; t[1] += s.new_tokens; t[2] += s.accepted; t[3] += s.proposed; t[4] += s.rounds
        line += f" | {name} {s.decode_s / s.new_tokens * 1e3:.1f} ms kept {s.accepted}/{s.proposed} rounds {s.rounds} drafted {s.proposed_at[0] if s.proposed_at else 0}"
    print(line, flush=True)
for name, t in tot.items():
    print(f"{name}: {t[0] / t[1] * 1e3:.1f} ms/token kept {t[2]}/{t[3]} rounds {t[4]}")
