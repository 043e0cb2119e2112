"""Groups inprocess_load.py's step log of one mode by the step's shape (rows, widest draft, draft forwards): tokens/s
the steps ran at against what the policy predicted for the k it chose and for a plain step, and the ks it chose.

python3 docs/experiments/throttle-zen4/steps_by_kind.py steps.jsonl on
"""
import collections, json, sys

steps = [json.loads(line) for line in open(sys.argv[1])]
mode = sys.argv[2] if len(sys.argv) > 2 else "on"
by = collections.defaultdict(list)
for s in steps:
    if "catch_up" not in s and s["mode"] == mode:
        by[(s["rows"], s["k"] or 0, s["forwards"] or 0)].append(s)
for (rows, k, forwards), group in sorted(by.items()):
    seconds, emitted = sum(s["total_s"] for s in group), sum(s["emitted"] for s in group)
    choices = [s["choice"] for s in group if s.get("choice")]
    chosen = [c["pred"][c["k"]] for c in choices]
    plain = [c["pred"][0] for c in choices]
    mean = lambda xs: sum(xs) / max(1, len(xs))
    print(f"rows {rows} widest {k} forwards {forwards}: {len(group):4d} steps, {emitted / seconds:5.1f} tok/s run, "
          f"{emitted / len(group):.2f} tok/step, {1000 * seconds / len(group):.0f} ms/step; predicted {mean(chosen):.1f} "
          f"for the k chosen, {mean(plain):.1f} plain; ks chosen {dict(collections.Counter(c['k'] for c in choices))}")
