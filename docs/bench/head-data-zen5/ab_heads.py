# A/B: heads given as NAME=DIR, each as `head` and `hybrid-head`, beside `none` and `draft`: the bench's 21 prompts
# (3 Spec-Bench per category plus 3 code; evaluation only, never trained on), 48 new tokens, interleaved per prompt
# (the order flips every prompt and repeat), one process, one copy of the target on its timed kernels for every engine.
# Run from the repository: python docs/bench/head-data-zen5/ab_heads.py REPEATS NAME=DIR NAME=DIR ...
# (the first head is the one the others are compared with)
import statistics, sys, time
from draftwise import Engine
from draftwise.backends.kernels import on_timed_kernels
from draftwise.bench.prompts import default_prompts, select_prompts
from draftwise.loading import load_models
from draftwise.tokenizers import encode_prompt

REPEATS = int(sys.argv[1])
HEADS = dict(arg.split("=", 1) for arg in sys.argv[2:])
target, tok, draft = load_models("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "auto", "cpu",
                                 progress=False)
fast = on_timed_kernels(target)
engines = {name: Engine.from_models(fast, tok, None, method="head", loaded_model=target, head=d) for name, d in HEADS.items()}
engines["draft"] = Engine.from_models(fast, tok, draft, method="draft", loaded_model=target)
first = next(iter(HEADS))
ARMS = [("none", engines[first], "none"), ("draft", engines["draft"], "draft")]
ARMS += [(f"{m}:{h}", engines[h], m) for m in ("head", "hybrid-head") for h in HEADS]
prompts = select_prompts(default_prompts(), per_category=3)
encoded = [encode_prompt(tok, p.text, chat=True) for p in prompts]
for _, e, m in ARMS:
    e.generate(encoded[0], method=m, max_new_tokens=16, ignore_eos=True)
res, start = {}, time.time()
for rep in range(REPEATS):
    for i, ids in enumerate(encoded):
        for name, e, m in (ARMS if (rep + i) % 2 == 0 else ARMS[::-1]):
            s = e.generate(ids, method=m, max_new_tokens=48, ignore_eos=True).stats
            res.setdefault((name, i), []).append((s.tokens_per_s, s.accepted or 0, s.proposed or 0,
                                                  s.new_tokens, s.target_forwards))
    print(f"repeat {rep} done at {time.time() - start:.0f} s", flush=True)
med = lambda a, i: statistics.median(x[0] for x in res[(a, i)])
for i, p in enumerate(prompts):
    print(f"{p.category} #{p.question_id}", " | ".join(f"{a} {med(a, i):.1f}" for a, _, _ in ARMS))
for a, _, _ in ARMS[1:]:
    rows = [x for i in range(len(prompts)) for x in res[(a, i)]]
    kept, offered = sum(x[1] for x in rows), sum(x[2] for x in rows)
    print(f"{a}: kept {kept} of {offered} offered ({100 * kept / max(1, offered):.1f}%), "
          f"{sum(x[3] for x in rows) / max(1, sum(x[4] for x in rows)):.2f} tokens a target pass")
pairs = [(f"{m}:{h}", f"{m}:{first}") for m in ("head", "hybrid-head") for h in HEADS if h != first]
pairs += [(a, "none") for a, _, _ in ARMS[1:]] + [(a, "draft") for a, _, _ in ARMS[2:]]
for a, b in pairs:
    rs = [med(a, i) / med(b, i) for i in range(len(prompts))]
    cats = {}
    for r, p in zip(rs, prompts):
        cats.setdefault(p.category, []).append(r)
    by_cat = ", ".join(f"{c} {statistics.geometric_mean(v):.2f}" for c, v in cats.items())
    print(f"{a} / {b}: geo-mean {statistics.geometric_mean(rs):.3f}, below 0.99 on {sum(r < 0.99 for r in rs)} of "
          f"{len(rs)}, min {min(rs):.3f}; {by_cat}", flush=True)
