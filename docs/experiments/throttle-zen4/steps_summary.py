"""Sums inprocess_load.py's step log by mode and batch size: tokens/s of the steps, draft and verify seconds, catch-ups."""
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
by = collections.defaultdict(list)
cu = collections.defaultdict(list)
ops = collections.defaultdict(list)
for r in rows:
    if "catch_up" in r: cu[r["mode"]].append(r); continue
    if "op" in r: ops[(r["mode"], r["op"])].append(r["s"]); continue
    by[(r["mode"], r["rows"])].append(r)
for (mode, n), steps in sorted(by.items()):
    tot = sum(s["total_s"] for s in steps); em = sum(s["emitted"] for s in steps)
    d = sum(s["draft_s"] for s in steps); v = sum(s["verify_s"] for s in steps)
    drafting = sum(1 for s in steps if s["draft_s"] > 0.005)
    print(f"{mode:8s} rows {n}: steps {len(steps):4d} time {tot:6.1f}s emitted {em:5d} -> {em/tot:5.1f} tok/s, "
          f"draft {d:5.1f}s verify {v:5.1f}s other {tot-d-v:4.1f}s, steps drafting {drafting}, tok/step {em/len(steps):.2f}, "
          f"verify/step {1000*v/len(steps):.0f}ms")
for mode, c in cu.items():
    print(mode, "catch-ups", len(c), "tokens", sum(x["catch_up"] for x in c), "seconds", round(sum(x["s"] for x in c), 2))
for (mode, op), secs in sorted(ops.items()):
    print(f"{mode:8s} {op}: {len(secs)} calls, {sum(secs):.2f} s, longest {max(secs):.2f} s")
