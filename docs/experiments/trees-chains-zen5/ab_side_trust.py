# A/B: tree sizing that judges the nodes off the chain of first choices apart from the chain (new) against the
# sizing of the commit before, which judged every node of a depth together (old), as `draft-tree`, beside `draft`
# (and, with --head, as `head`): the bench's 21 prompts (3 Spec-Bench per category plus 3 code; evaluation only),
# 48 new tokens, interleaved per prompt (the order flips every prompt), one process, one engine per arm on the same
# loaded models. The old sizing is the file at OLD_COMMIT, loaded beside the new and swapped in around its arm's
# requests.
# The new sizing is side_trust.patch, which did not land (it measured 0.966x the old; ab_side_trust.txt). To run it
# again: git checkout 0682fba && git apply docs/bench/trees-chains-zen5/side_trust.patch, then from the repository:
# python docs/bench/trees-chains-zen5/ab_side_trust.py 0682fba [repeats] [--head]
import importlib.util, statistics, subprocess, sys, tempfile, time
from draftwise import Engine
from draftwise.bench.prompts import default_prompts, select_prompts
from draftwise.loading import load_models
from draftwise.proposers.tree_growth import TreeSizing
from draftwise.tokenizers import encode_prompt

OLD_COMMIT = sys.argv[1]
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 2
HEAD = "--head" in sys.argv
source = subprocess.run(["git", "show", f"{OLD_COMMIT}:draftwise/proposers/tree_growth.py"], check=True,
                        capture_output=True, text=True).stdout
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(source)
spec = importlib.util.spec_from_file_location("old_tree_growth", f.name)
old = sys.modules["old_tree_growth"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
spec.loader.exec_module(old)
SWAPPED = ("trust", "observe", "chance", "choose", "to_expand")
NEW_SIZING = {name: getattr(TreeSizing, name) for name in SWAPPED}
OLD_SIZING = {name: getattr(old.TreeSizing, name) for name in SWAPPED}
OLD_SIZING["observe"] = lambda self, num_accepted, path=None: old.TreeSizing.observe(self, num_accepted)


def sizing(kind):
    for name, fn in (OLD_SIZING if kind == "old" else NEW_SIZING).items():
        setattr(TreeSizing, name, fn)


target, tok, draft = load_models("qwen2.5-coder-1.5b-instruct", None if HEAD else "qwen2.5-coder-0.5b-instruct",
                                 "auto", "cpu", progress=False)
method = "head" if HEAD else "draft-tree"
engines = {kind: Engine.from_models(target, tok, draft, method=method) for kind in ("old", "new")}
chain = ("none", "new", "none") if HEAD else ("draft", "new", "draft")  # the head has no chain of its own
ARMS = [chain, (f"{method}:old", "old", method), (f"{method}:new", "new", method)]
prompts = select_prompts(default_prompts(), per_category=3)
encoded = [encode_prompt(tok, p.text, chat=True) for p in prompts]
for _, kind, m in ARMS:
    sizing(kind)
    engines[kind].generate(encoded[0], method=m, max_new_tokens=16, ignore_eos=True)
res, start = {}, time.time()
for rep in range(REPEATS):
    for i, ids in enumerate(encoded):
        for name, kind, m in (ARMS if (rep + i) % 2 == 0 else ARMS[::-1]):
            sizing(kind)
            r = engines[kind].generate(ids, method=m, max_new_tokens=48, ignore_eos=True)
            s = r.stats
            res.setdefault((name, i), []).append((s.tokens_per_s, s.accepted or 0, s.nodes or 0, s.rounds or 0,
                                                  s.target_forwards, s.verify_s, r.token_ids))
    print(f"repeat {rep} done at {time.time() - start:.0f} s", flush=True)
med = lambda a, i: statistics.median(x[0] for x in res[(a, i)])
for i, p in enumerate(prompts):
    print(f"{p.category} #{p.question_id}", " | ".join(f"{a} {med(a, i):.1f}" for a, _, _ in ARMS))
for a, _, _ in ARMS:
    runs = [x for i in range(len(prompts)) for x in res[(a, i)]]
    rounds, passes = sum(x[3] for x in runs), sum(x[4] for x in runs)
    print(f"{a}: kept {sum(x[1] for x in runs)} of {sum(x[2] for x in runs)} nodes offered in {rounds} rounds "
          f"({sum(x[2] for x in runs) / max(1, rounds):.2f} a round), {48 * len(runs) / passes:.2f} tokens a pass, "
          f"{1000 * sum(x[5] for x in runs) / passes:.1f} ms a pass")
first = ARMS[0][0]
for a, b in ((ARMS[2][0], ARMS[1][0]), (ARMS[2][0], first), (ARMS[1][0], first)):
    rs = [med(a, i) / med(b, i) for i in range(len(prompts))]
    cats = {}
    for r, p in zip(rs, prompts):
        cats.setdefault(p.category, []).append(r)
    by_cat = ", ".join(f"{c} {statistics.geometric_mean(v):.2f}" for c, v in cats.items())
    print(f"{a} / {b}: geo-mean {statistics.geometric_mean(rs):.3f}, below 0.99 on {sum(r < 0.99 for r in rs)} of "
          f"{len(rs)}, min {min(rs):.3f}; {by_cat}", flush=True)
same = sum(res[(ARMS[1][0], i)][0][6] == res[(ARMS[2][0], i)][0][6] for i in range(len(prompts)))
print(f"identical texts, {ARMS[1][0]} and {ARMS[2][0]} (first repeat): {same} of {len(prompts)}")
