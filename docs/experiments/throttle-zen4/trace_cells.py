"""A traced server's steps (traced_serve.py) cut into loadgen's cells, and what each cell's engine did: its steps and
their seconds, the steps that drafted against what plain steps of the cell would have taken for their tokens, the
catch-ups and prefills, and the cell's plain step (the median of its steps that drafted nothing, at its commonest
batch size). A cell's plain step beside its off cell's says how fast the machine ran in each: where on ran the same
steps as off (no drafting), a gap between them is the machine's drift, not the policy's.

python docs/experiments/throttle-zen4/trace_cells.py TRACE.jsonl METHODS LEVELS REPEATS [SLICES [REQUESTS]]
(the loadgen run's --methods, --concurrency, --repeats, --slices and --requests: its cells are replayed in its order,
warm-ups included)"""
import collections, json, os, statistics, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../.."))
from draftwise.bench.loadgen import LoadPlan  # noqa: E402

PROMPTS = 8  # the run's prompts (a cell sends max(prompts, level) requests unless told --requests)


def expected_cells(methods, levels, repeats, slices=1, requests=PROMPTS):
    plan = LoadPlan(url="http://127.0.0.1:1", levels=tuple(levels), modes=("on", "always", "off"), prompts=(),
                    requests=requests, methods=tuple(methods), repeats=repeats, slices=slices)
    for level in levels:
        parts, warm = plan.parts(level), set()
        for repeat, part, mode, method in plan.schedule(level):
            if (mode, method) not in warm:
                warm.add((mode, method))
                yield dict(level=level, repeat=repeat, mode=mode, method=method, warm_up=True, requests=level)
            yield dict(level=level, repeat=repeat, mode=mode, method=method, warm_up=False,
                       requests=len(parts[part]))


def cells_of(trace, methods, levels, repeats, slices=1, requests=PROMPTS):
    """The trace's counted cells, each cell's slices (loadgen --slices) joined into one, in the order they began."""
    joined = {}
    for c in cut(trace, expected_cells(methods, levels, repeats, slices, requests)):
        if c["warm_up"]:
            continue
        key = (c["level"], c["repeat"], c["mode"], c["method"])
        if key in joined:
            for name in ("steps", "catch_ups", "ops"):
                joined[key][name] += c[name]
        else:
            joined[key] = c
    return [c for c in joined.values() if c["steps"]]


def run_args(argv):
    """METHODS LEVELS REPEATS [SLICES [REQUESTS]], as the loadgen run was given them."""
    methods, levels, repeats = argv[0].split(","), [int(c) for c in argv[1].split(",")], int(argv[2])
    return methods, levels, repeats, *[int(v) for v in argv[3:5]]


def cut(trace, cells):
    """Each line of the trace to the cell in progress: a cell ends with its last request's close."""
    cells = iter(cells)
    cell = dict(next(cells), steps=[], catch_ups=[], ops=[], closed=0)
    out = [cell]
    for line in trace:
        if "op" in line:
            cell["ops"].append(line)
            if line["op"] == "close_sequence":
                cell["closed"] += 1
                if cell["closed"] == cell["requests"]:
                    nxt = next(cells, None)
                    if nxt is None:
                        break
                    cell = dict(nxt, steps=[], catch_ups=[], ops=[], closed=0)
                    out.append(cell)
        elif "catch_up" in line:
            cell["catch_ups"].append(line)
        else:
            cell["steps"].append(line)
    return out


def plain_steps(cell):
    """The cell's plain step by rows: the median seconds of its steps that drafted nothing."""
    by_rows = collections.defaultdict(list)
    for s in cell["steps"]:
        if not s["k"]:
            by_rows[s["rows"]].append(s["total_s"])
    return {n: statistics.median(v) for n, v in by_rows.items()}


def summary(cell):
    steps = cell["steps"]
    rows = collections.Counter(s["rows"] for s in steps).most_common(1)[0][0] if steps else 0
    plain = plain_steps(cell)
    drafting = [s for s in steps if s["k"]]
    drafted_s = sum(s["total_s"] for s in drafting)
    # what plain steps would have taken for the drafting steps' tokens (where this cell ran plain steps of their rows)
    as_plain = sum(s["emitted"] / s["rows"] * plain[s["rows"]] for s in drafting if s["rows"] in plain)
    return dict(steps=len(steps), step_s=sum(s["total_s"] for s in steps), emitted=sum(s["emitted"] for s in steps),
                drafting=len(drafting), drafted_s=drafted_s, as_plain_s=as_plain,
                catch_up_s=sum(c["s"] for c in cell["catch_ups"]),
                prefill_s=sum(o["s"] for o in cell["ops"] if o["op"] == "prefill"),
                rows=rows, plain_ms=1000 * plain.get(rows, float("nan")))


def busy_s(s):
    return s["step_s"] + s["catch_up_s"] + s["prefill_s"]


def on_against_off(cells):
    """Per level, method and repeat: off's busy seconds over on's, as run, and with on's busy seconds taken at off's
    plain step (on's scaled by off's plain step over its own): where the two cells ran the same steps, what is left is
    the policy's, the machine's drift between the two cells taken out."""
    by = {(c["level"], c["method"], c["repeat"], c["mode"]): summary(c) for c in cells}
    print("| c | method | repeat | on busy s | off busy s | plain step ms, on / off | off / on busy | the same at off's "
          "plain step |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for (level, method, repeat, mode), on in by.items():
        off = by.get((level, method, repeat, "off"))
        if mode != "on" or off is None:
            continue
        speed = off["plain_ms"] / on["plain_ms"] if on["plain_ms"] == on["plain_ms"] else float("nan")
        print(f"| {level} | {method} | {repeat + 1} | {busy_s(on):.1f} | {busy_s(off):.1f} | {on['plain_ms']:.0f} / "
              f"{off['plain_ms']:.0f} | {busy_s(off) / busy_s(on):.2f} | {busy_s(off) / (busy_s(on) * speed):.2f} |")


def main():
    trace = [json.loads(line) for line in open(sys.argv[1])]
    cells = cells_of(trace, *run_args(sys.argv[2:]))
    print("| c | method | repeat | mode | steps | step s | drafting steps: s (as plain) | catch-up s | prefill s "
          "| plain step ms (rows) | busy s |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for c in cells:
        s = summary(c)
        busy = busy_s(s)
        print(f"| {c['level']} | {c['method']} | {c['repeat'] + 1} | {c['mode']} | {s['steps']} | {s['step_s']:.1f} | "
              f"{s['drafting']}: {s['drafted_s']:.1f} ({s['as_plain_s']:.1f}) | {s['catch_up_s']:.1f} | "
              f"{s['prefill_s']:.1f} | {s['plain_ms']:.0f} ({s['rows']}) | {busy:.1f} |")
    print()
    on_against_off(cells)


if __name__ == "__main__":
    main()
