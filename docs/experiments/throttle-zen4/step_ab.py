"""Issue 58: engine.step on 6 rows opened as `none` against 6 opened as hybrid-tree (adaptive), alternating: each step's verify
seconds, and whether it drafted."""
import json, time, statistics, sys
from draftwise import Engine
from draftwise.config import GenerationConfig
from draftwise.tokenizers import encode_prompt
engine = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "hybrid", backend="quant")
prompts = [json.loads(l)["turns"][0] for l in open("docs/experiments/invariance-zen4/prompts-unseen.jsonl")][:6]
ids = [encode_prompt(engine.tokenizer, p, chat=True) for p in prompts]
def opened(method):
    cfg = GenerationConfig.from_options(max_new_tokens=200, temperature=0.0, method=method, ignore_eos=True)
    seqs = [engine.open_sequence(i, cfg) for i in ids]
    for s in seqs: engine.prefill(s)
    return seqs
sets = {m: opened(m) for m in sys.argv[1].split(",")}
stats = {m: [] for m in sets}
for r in range(int(sys.argv[2])):
    for m, seqs in (sets.items() if r % 2 == 0 else reversed(sets.items())):
        t0 = time.perf_counter()
        ev = engine.step(seqs)
        total = time.perf_counter() - t0
        lt = engine.last_step
        emitted = sum(sum(e.token_id is not None for e in ev[s]) for s in seqs)
        stats[m].append((lt.verify_s, lt.draft_s, total, emitted))
for m, v in stats.items():
    plain = [x for x in v[4:] if x[3] == len(sets[m])]
    print(m, "steps", len(v), "plain", len(plain), "verify median %.1f ms" % (1000 * statistics.median(x[0] for x in plain)),
          "total median %.1f" % (1000 * statistics.median(x[2] for x in plain)), "all steps %.2f s for %d tokens" % (sum(x[2] for x in v), sum(x[3] for x in v)))
