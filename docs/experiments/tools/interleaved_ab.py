# What the interleaved A/B scripts of head-fuse-zen5 and head-data-zen5 share: the bench's 21 prompts (3 Spec-Bench per
# category plus 3 code; evaluation only, never trained on), 48 new tokens, every arm on each prompt in turn (the order
# flips every prompt and repeat), one process; then per prompt the median tokens/s, per arm what it kept, and per pair
# the geometric mean of the per-prompt ratios. An arm: (name, engine, method).
import statistics
import time
from draftwise.bench.prompts import default_prompts, select_prompts
from draftwise.tokenizers import encode_prompt


def run_interleaved(arms, tokenizer, repeats: int):
    """(the prompts, {(arm name, prompt index): [(tokens/s, accepted, proposed, new tokens, target passes)]})."""
    prompts = select_prompts(default_prompts(), per_category=3)
    encoded = [encode_prompt(tokenizer, p.text, chat=True) for p in prompts]
    for _, e, m in arms:
        e.generate(encoded[0], method=m, max_new_tokens=16, ignore_eos=True)
    res, start = {}, time.time()
    for rep in range(repeats):
        for i, ids in enumerate(encoded):
            for name, e, m in (arms if (rep + i) % 2 == 0 else arms[::-1]):
                s = e.generate(ids, method=m, max_new_tokens=48, ignore_eos=True).stats
                res.setdefault((name, i), []).append((s.tokens_per_s, s.accepted or 0, s.proposed or 0,
                                                      s.new_tokens, s.target_forwards))
        print(f"repeat {rep} done at {time.time() - start:.0f} s", flush=True)
    return prompts, res


def report(arms, prompts, res, pairs) -> None:
    """Prints the per-prompt medians, each arm but the first's acceptance, and each pair's (a, b) ratio a / b."""
    med = lambda a, i: statistics.median(x[0] for x in res[(a, i)])
    for i, p in enumerate(prompts):
        print(f"{p.category} #{p.question_id}", " | ".join(f"{a} {med(a, i):.1f}" for a, _, _ in arms))
    for a, _, _ in arms[1:]:
        rows = [x for i in range(len(prompts)) for x in res[(a, i)]]
        kept, offered = sum(x[1] for x in rows), sum(x[2] for x in rows)
        print(f"{a}: kept {kept} of {offered} offered ({100 * kept / max(1, offered):.1f}%), "
              f"{sum(x[3] for x in rows) / max(1, sum(x[4] for x in rows)):.2f} tokens a target pass")
    for a, b in pairs:
        rs = [med(a, i) / med(b, i) for i in range(len(prompts))]
        cats = {}
        for r, p in zip(rs, prompts):
            cats.setdefault(p.category, []).append(r)
        by_cat = ", ".join(f"{c} {statistics.geometric_mean(v):.2f}" for c, v in cats.items())
        print(f"{a} / {b}: geo-mean {statistics.geometric_mean(rs):.3f}, below 0.99 on {sum(r < 0.99 for r in rs)} of "
              f"{len(rs)}, min {min(rs):.3f}; {by_cat}", flush=True)
