# A/B: the chain hybrid's lookup sized by the measured costs (new) vs by k (old: its lookup given no costs), beside
# draft and none. Off-bench requests (draftwise.head.answers at seed 7), interleaved per prompt, one process.
# Run from the repository: python docs/bench/lookup-judged-zen5/ab_chain_hybrid.py [prompts] [repeats]
import statistics, sys, time
from draftwise import Engine
from draftwise.head.answers import answer_prompts
from draftwise.proposers.hybrid import HybridProposer
NEW = HybridProposer.costs.fset
def old_set(self, costs):
    self._costs = costs
    self.lookup.costs = None
T, D = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
eng = Engine.from_pretrained(target=T, draft=D, method="hybrid")
PROMPTS = [messages for _, messages in answer_prompts(int(sys.argv[1]) if len(sys.argv) > 1 else 12, seed=7)]
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
ARMS = ["none", "draft", "hybrid:new", "hybrid:old"]
def run(arm, p, n):
    method, _, variant = arm.partition(":")
    HybridProposer.costs = property(HybridProposer.costs.fget, old_set if variant == "old" else NEW)
    return eng.generate(p, method=method, max_new_tokens=n).stats
for arm in ARMS:
    run(arm, PROMPTS[0], 16)
res, start = {}, time.time()
for rep in range(REPEATS):
    for i, p in enumerate(PROMPTS):
        for arm in (ARMS if (rep + i) % 2 == 0 else ARMS[::-1]):
            s = run(arm, p, 96)
            res.setdefault((arm, i), []).append((s.new_tokens / s.decode_s, s.target_forwards))
    print(f"repeat {rep} done at {time.time() - start:.0f} s", flush=True)
med = lambda a, i, j=0: statistics.median(x[j] for x in res[(a, i)])
for i in range(len(PROMPTS)):
    print(f"p{i}", " | ".join(f"{a} {med(a, i):.1f} tok/s {med(a, i, 1):.0f} passes" for a in ARMS))
for a, b in (("hybrid:new", "hybrid:old"), ("hybrid:new", "draft"), ("hybrid:old", "draft"), ("hybrid:new", "none")):
    rs = [med(a, i) / med(b, i) for i in range(len(PROMPTS))]
    print(f"{a} / {b}: geo-mean {statistics.geometric_mean(rs):.3f}, below 0.99 on {sum(r < 0.99 for r in rs)} of "
          f"{len(rs)}, min {min(rs):.3f}", flush=True)
