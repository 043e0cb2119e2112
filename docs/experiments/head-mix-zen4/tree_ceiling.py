# Offline, evaluation only (never trained on): over the target's greedy answers to 56 bench prompts (bench_top1.py's, in
# /tmp/diag), grow the head's tree to DEPTH at every position as the engine does with no costs measured (WIDTH nodes a
# depth), and count for the n likeliest nodes how many tokens beyond the target's own one pass would keep.
# Run from the repository: python docs/bench/head-mix-zen4/tree_ceiling.py HEAD_DIR DEPTH EVERY WINDOW|none CATEGORIES
import sys, collections, torch, os
from draftwise.loading import load_models, head_proposer
from draftwise.config import SamplingConfig
target, tok, _ = load_models("qwen2.5-coder-1.5b-instruct", None, "auto", "cpu", progress=False)
head = os.path.expanduser(sys.argv[1]); DEPTH = int(sys.argv[2]); EVERY = int(sys.argv[3])
seqs = torch.load("/tmp/diag/bench_answers_8_96.pt")
p = head_proposer(target, head); W = sys.argv[4]; p.window = None if W == "none" else int(W); CATS = sys.argv[5].split(",")
NS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24]
kept = {c: collections.Counter() for c in ["all"] + sorted({s["category"] for s in seqs})}
count = collections.Counter()
claim = collections.defaultdict(lambda: [0.0, 0])  # depth -> [sum exp(score) of top node at depth, kept]
for si, s in enumerate(seqs):
    if si % EVERY or s["category"] not in CATS: continue
    ids, feats, wanted = s["ids"].tolist(), s["features"], s["next"].tolist()
    first = max(1, s.get("answer_start", 0) - 1)
    p.begin(ids[: first + 1], SamplingConfig(), torch.Generator()); p.add_features(0, feats[:first])
    for last in range(first, len(ids) - 1):
        if last > first: p.add_features(last - 1, feats[last - 1: last])
        if not p._catch_up(ids[: last + 1], last): continue
        n0 = len(p.cache)
        tree, _ = p._grow(last, ids[last], depth=DEPTH)
        p.cache.trim(n0)
        order = sorted(range(len(tree.scores)), key=lambda n: (-tree.scores[n], n))
        truth = wanted[last:]
        for n in NS:
            chosen = set(order[:n]); node, depth = -1, 0
            while depth < len(truth):
                nxt = [c for c in chosen if tree.parents[c] == node and tree.tokens[c] == truth[depth]]
                if not nxt: break
                node, depth = nxt[0], depth + 1
            for c in ("all", s["category"]): kept[c][n] += depth
        for c in ("all", s["category"]): count[c] += 1
print("tokens kept per pass beyond the target's own, by n likeliest nodes offered (head:", head, "depth", DEPTH, ")")
for c in kept:
    if count[c]: print(f"{c:15s} {count[c]:5d} pos |", " ".join(f"n{n}:{kept[c][n]/count[c]:.2f}" for n in NS), flush=True)
