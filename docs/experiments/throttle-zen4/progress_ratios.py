"""on over the better of always and off, cell by cell, from a loadgen run's progress log (one that was stopped
before its report): python docs/experiments/throttle-zen4/progress_ratios.py PROGRESS.log"""
import re, sys, statistics, collections
cells = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    m = re.search(r"speculation (on|always|off), (?:beside )?([\w-]+), concurrency (\d+), repeat (\d+): \d+ requests, ([\d.]+) tok/s", line)
    if m:
        mode, method, c, r, tps = m.groups()
        cells[(method, int(c))].setdefault(int(r), {})[mode] = float(tps)
for (method, c), reps in sorted(cells.items(), key=lambda x: (x[0][1], x[0][0])):
    ratios = [v["on"] / max(v.get("always", 0), v.get("off", 0)) for v in reps.values() if len(v) == 3]
    on = [v.get("on") for v in reps.values()]; al = [v.get("always") for v in reps.values()]; off = [v.get("off") for v in reps.values()]
    print(f"{method:12} c{c}: on {on} always {al} off {off} -> " + (f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"))
