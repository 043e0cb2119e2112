# A/B: prompt lookup judged per round (new, f8e60a0) vs under the shared draft length (old: 5605353's proposer in
# the same engine), for lookup and lookup-tree, beside none. Off-bench prompts (package docs and code on this
# machine, draftwise.head.answers' requests at another seed than the head's), interleaved per prompt, one process.
# Run from the repository: python docs/bench/lookup-judged-zen5/ab_old_lookup.py [prompts] [repeats]
import importlib.util, statistics, subprocess, sys, tempfile, time
from draftwise import Engine
from draftwise.config import LOOKUP_BRANCHES
from draftwise.head.answers import answer_prompts
OLD_SOURCE = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
OLD_SOURCE.write(subprocess.check_output(["git", "show", "5605353:draftwise/proposers/prompt_lookup.py"], text=True))
OLD_SOURCE.close()
spec = importlib.util.spec_from_file_location("old_prompt_lookup", OLD_SOURCE.name)
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)

class OldEngine(Engine):
    def _new_proposer(self, method):
        if method in LOOKUP_BRANCHES:
            return old.PromptLookupProposer(corpus=self.proposal_cache, branches=LOOKUP_BRANCHES[method])
        return super()._new_proposer(method)

T = "qwen2.5-coder-1.5b-instruct"
new_eng = Engine.from_pretrained(target=T, method="lookup")
old_eng = Engine.from_pretrained(target=T, method="lookup")
old_eng.__class__ = OldEngine
old_eng.proposer = old.PromptLookupProposer(branches=1)
PROMPTS = [messages for _, messages in answer_prompts(int(sys.argv[1]) if len(sys.argv) > 1 else 12, seed=7)]
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
ARMS = [("none", new_eng, "none"), ("lookup:new", new_eng, "lookup"), ("lookup:old", old_eng, "lookup"),
        ("lookup-tree:new", new_eng, "lookup-tree"), ("lookup-tree:old", old_eng, "lookup-tree")]
for _, e, m in ARMS:
    e.generate(PROMPTS[0], method=m, max_new_tokens=16)
res = {}
start = time.time()
for rep in range(REPEATS):
    for i, p in enumerate(PROMPTS):
        arms = ARMS if (rep + i) % 2 == 0 else ARMS[::-1]
        for name, e, m in arms:
            s = e.generate(p, method=m, max_new_tokens=96).stats
            res.setdefault((name, i), []).append((s.new_tokens / s.decode_s, s.target_forwards, s.nodes or 0))
    print(f"repeat {rep} done at {time.time() - start:.0f} s", flush=True)
med = lambda a, i, j=0: statistics.median(x[j] for x in res[(a, i)])
for i in range(len(PROMPTS)):
    print(f"p{i}", " | ".join(f"{a} {med(a, i):.1f} tok/s {med(a, i, 1):.0f} passes" for a, _, _ in ARMS))
for a, b in (("lookup:new", "lookup:old"), ("lookup-tree:new", "lookup-tree:old"), ("lookup-tree:new", "lookup:new"),
             ("lookup-tree:old", "lookup:old"), ("lookup:new", "none"), ("lookup:old", "none")):
    rs = [med(a, i) / med(b, i) for i in range(len(PROMPTS))]
    print(f"{a} / {b}: geo-mean {statistics.geometric_mean(rs):.3f}, below 0.99 on {sum(r < 0.99 for r in rs)} of {len(rs)}, "
          f"min {min(rs):.3f}", flush=True)
