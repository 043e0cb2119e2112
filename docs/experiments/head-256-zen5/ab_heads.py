# A/B: the head of 64 answers (old, 4bc6601's defaults) against the head of 256 answers (new, 9b91e36's), as `head`
# and `hybrid-head`, beside `none`: the bench's 21 prompts (3 Spec-Bench per category plus 3 code; evaluation only,
# never trained on), 48 new tokens, interleaved per prompt (the order flips every prompt), one process, one copy of
# the target on its timed kernels shared by every engine.
# Run from the repository: python docs/bench/head-256-zen5/ab_heads.py OLD_HEAD_DIR NEW_HEAD_DIR [repeats]
import statistics, sys, time
from draftwise import Engine
from draftwise.backends.kernels import on_timed_kernels
from draftwise.bench.prompts import default_prompts, select_prompts
from draftwise.loading import load_models
from draftwise.tokenizers import encode_prompt

OLD, NEW = sys.argv[1], sys.argv[2]
REPEATS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
target, tok, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
fast = on_timed_kernels(target)
engines = {name: Engine.from_models(fast, tok, None, method="head", loaded_model=target, head=folder)
           for name, folder in (("old", OLD), ("new", NEW))}
ARMS = [("none", engines["new"], "none"), ("head:old", engines["old"], "head"), ("head:new", engines["new"], "head"),
        ("hybrid-head:old", engines["old"], "hybrid-head"), ("hybrid-head:new", engines["new"], "hybrid-head")]
prompts = select_prompts(default_prompts(), per_category=3)
encoded = [encode_prompt(tok, p.text, chat=True) for p in prompts]
for _, e, m in ARMS:
    e.generate(encoded[0], method=m, max_new_tokens=16, ignore_eos=True)
res, start = {}, time.time()
for rep in range(REPEATS):
    for i, ids in enumerate(encoded):
        for name, e, m in (ARMS if (rep + i) % 2 == 0 else ARMS[::-1]):
            s = e.generate(ids, method=m, max_new_tokens=48, ignore_eos=True).stats
            res.setdefault((name, i), []).append((s.tokens_per_s, s.accepted or 0, s.proposed or 0))
    print(f"repeat {rep} done at {time.time() - start:.0f} s", flush=True)
med = lambda a, i: statistics.median(x[0] for x in res[(a, i)])
for i, p in enumerate(prompts):
    print(f"{p.category} #{p.question_id}", " | ".join(f"{a} {med(a, i):.1f}" for a, _, _ in ARMS))
for a, _, _ in ARMS[1:]:
    kept = sum(x[1] for i in range(len(prompts)) for x in res[(a, i)])
    offered = sum(x[2] for i in range(len(prompts)) for x in res[(a, i)])
    print(f"{a}: kept {kept} of {offered} offered ({100 * kept / max(1, offered):.1f}%)")
for a, b in (("head:new", "head:old"), ("hybrid-head:new", "hybrid-head:old"), ("head:new", "none"),
             ("head:old", "none"), ("hybrid-head:new", "none"), ("hybrid-head:old", "none")):
    rs = [med(a, i) / med(b, i) for i in range(len(prompts))]
    cats = {}
    for r, p in zip(rs, prompts):
        cats.setdefault(p.category, []).append(r)
    by_cat = ", ".join(f"{c} {statistics.geometric_mean(v):.2f}" for c, v in cats.items())
    print(f"{a} / {b}: geo-mean {statistics.geometric_mean(rs):.3f}, below 0.99 on {sum(r < 0.99 for r in rs)} of "
          f"{len(rs)}, min {min(rs):.3f}; {by_cat}", flush=True)
