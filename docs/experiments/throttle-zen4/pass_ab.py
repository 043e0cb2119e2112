"""Issue 58: Time the target's plain pass for 6 rows opened as `none` against 6 opened as hybrid-tree (k=0 passes), alternating."""
import json, time, statistics, sys
from draftwise import Engine
from draftwise.config import GenerationConfig
from draftwise.tokenizers import encode_prompt
engine = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "hybrid", backend="quant")
prompts = [json.loads(l)["turns"][0] for l in open("docs/experiments/invariance-zen4/prompts-unseen.jsonl")][:6]
ids = [encode_prompt(engine.tokenizer, p, chat=True) for p in prompts]
def opened(method):
    cfg = GenerationConfig.from_options(max_new_tokens=96, temperature=0.0, method=method)
    seqs = [engine.open_sequence(i, cfg) for i in ids]
    for s in seqs: engine.prefill(s)
    return seqs
sets = {m: opened(m) for m in sys.argv[1].split(",")}
def one_pass(seqs):
    lens = [len(s.context) for s in seqs]
    t0 = time.perf_counter()
    engine.target.forward_batch([(s.target, [s.context[-1]]) for s in seqs])
    dt = time.perf_counter() - t0
    for s, n in zip(seqs, lens): s.target.trim(n - 1)
    return dt
times = {m: [] for m in sets}
for r in range(40):
    for m, seqs in (sets.items() if r % 2 == 0 else reversed(sets.items())):
        times[m].append(one_pass(seqs))
for m, v in times.items():
    print(m, "median %.1f ms" % (1000 * statistics.median(v[4:])), "min %.1f" % (1000 * min(v)))
