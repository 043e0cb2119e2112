# What the side nodes of draft-tree add: per round, the tokens kept beyond the kept prefix of the chain of first
# choices (each node's first child in the Draft is its likeliest), on 4 prompts a category (Spec-Bench: evaluation
# only), 64 new tokens, the engine's defaults. Run from the repository at 0682fba:
# python docs/bench/trees-chains-zen5/side_gain.py code,mt_bench,qa,translation 4
import sys, statistics
from collections import defaultdict
from draftwise import Engine
from draftwise.bench.prompts import default_prompts
from draftwise.tokenizers import encode_prompt
from draftwise.proposers import draft_tree as dt

CATS = sys.argv[1].split(",") if len(sys.argv) > 1 else ["code"]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 8
log = []
orig_finish, orig_keep = dt.DraftTreeProposer.finish, dt.DraftTreeProposer.keep_path
def finish(self):
    d = orig_finish(self); self._dbg = d; return d
def keep(self, path):
    d = getattr(self, "_dbg", None)
    if d is not None and d.token_ids:
        parents = d.parents or tuple(range(-1, len(d.token_ids) - 1))
        first = {}
        for i, p in enumerate(parents):
            first.setdefault(p, i)
        main = 0; at = -1
        for node in path:
            if first.get(at) == node: main += 1; at = node
            else: break
        log.append((len(d.token_ids), len(path), main))
    return orig_keep(self, path)
dt.DraftTreeProposer.finish, dt.DraftTreeProposer.keep_path = finish, keep
e = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct")
ps = defaultdict(list)
for p in default_prompts(): ps[p.category].append(p)
for c in CATS:
    log.clear()
    for p in ps[c][:N]:
        e.generate(encode_prompt(e.tokenizer, p.text, chat=True), method="draft-tree", max_new_tokens=64, ignore_eos=True)
    R = len(log)
    print(c, f"rounds {R}: nodes/round {sum(n for n,_,_ in log)/R:.2f}, kept/round {sum(k for _,k,_ in log)/R:.2f}, "
          f"first-choice kept/round {sum(m for _,_,m in log)/R:.3f}, side gain/round {sum(k-m for _,k,m in log)/R:.3f}, "
          f"rounds where a side node was kept {sum(k>m for _,k,m in log)}", flush=True)
costs = e.draft_policy.costs
print("verify s by width (rows 1):", {n: round(s*1000,1) for n, s in sorted(costs._verify_s[1].seconds.items())})
