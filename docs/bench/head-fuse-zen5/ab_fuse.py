# A/B: the default head with its fuse layer on int8-dynamic (as before 14163fa) against the same head with the fuse on
# the model's own values (14163fa), and a head trained 10 epochs on the same data, as `head` and `hybrid-head`, beside
# `none` and `draft`: the bench's 21 prompts (3 Spec-Bench per category plus 3 code; evaluation only, never trained
# on), 48 new tokens, interleaved per prompt (the order flips every prompt), one process, one copy of the target on
# its timed kernels shared by every engine.
# Run from the repository: python docs/bench/head-fuse-zen5/ab_fuse.py HEAD_DIR [HEAD10_DIR or -] [repeats]
import statistics, sys, time
import draftwise.loading as loading
from draftwise import Engine
from draftwise.backends.kernels import kernel_counts, on_timed_kernels
from draftwise.bench.prompts import default_prompts, select_prompts
from draftwise.loading import load_models
from draftwise.tokenizers import encode_prompt

HEAD = sys.argv[1]
HEAD10 = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
REPEATS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
target, tok, draft = load_models("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "auto", "cpu",
                                 progress=False)
fast = on_timed_kernels(target)
fixed = loading.EXACT_INPUT_LAYERS
loading.EXACT_INPUT_LAYERS = ()  # the fuse on whatever kernel is timed fastest, as before 14163fa
engines = {"int8fuse": Engine.from_models(fast, tok, None, method="head", loaded_model=target, head=HEAD)}
loading.EXACT_INPUT_LAYERS = fixed
engines["fixed"] = Engine.from_models(fast, tok, None, method="head", loaded_model=target, head=HEAD)
if HEAD10:
    engines["e10"] = Engine.from_models(fast, tok, None, method="head", loaded_model=target, head=HEAD10)
engines["draft"] = Engine.from_models(fast, tok, draft, method="draft", loaded_model=target)
for name, e in engines.items():
    print(name, e.speed_paths.get("head", {}).get("kernels") or e.speed_paths.get("draft_kernels"))
ARMS = [("none", engines["fixed"], "none"), ("draft", engines["draft"], "draft")]
ARMS += [(f"{m}:{h}", engines[h], m) for m in ("head", "hybrid-head") for h in engines if h != "draft"]
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
pairs = [("head:fixed", "head:int8fuse"), ("hybrid-head:fixed", "hybrid-head:int8fuse")]
if HEAD10:
    pairs += [("head:e10", "head:fixed"), ("hybrid-head:e10", "hybrid-head:fixed")]
pairs += [(a, "none") for a, _, _ in ARMS[1:]] + [(a, "draft") for a, _, _ in ARMS[2:]]
for a, b in pairs:
    rs = [med(a, i) / med(b, i) for i in range(len(prompts))]
    cats = {}
    for r, p in zip(rs, prompts):
        cats.setdefault(p.category, []).append(r)
    by_cat = ", ".join(f"{c} {statistics.geometric_mean(v):.2f}" for c, v in cats.items())
    print(f"{a} / {b}: geo-mean {statistics.geometric_mean(rs):.3f}, below 0.99 on {sum(r < 0.99 for r in rs)} of "
          f"{len(rs)}, min {min(rs):.3f}; {by_cat}", flush=True)
