"""What each `on` cell of a traced server (traced_serve.py) spent on drafting, by the kind of step: probes (drafting
lost the choice, a token drafted to notice a change), wins (drafting won it) and steps no choice priced (prompt
lookup's own rounds), each with its seconds and what plain steps of the cell would have taken for its tokens; the
seconds of filling lagging drafts; and for the wins, the rate the policy priced against the rate run, by rows.

python docs/experiments/throttle-zen4/drafting_steps.py TRACE.jsonl METHODS LEVELS REPEATS [SLICES [REQUESTS]]
(the loadgen run's --methods, --concurrency, --repeats, --slices and --requests, as trace_cells.py takes them)"""
import collections, json, os, sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../.."))
import trace_cells  # noqa: E402
from draftwise.planner import chain_tokens  # noqa: E402


def kind(step):
    choice = step.get("choice")
    if not choice:
        return "unpriced"
    priced = choice["pred"]
    return "probe" if max(range(len(priced)), key=priced.__getitem__) == 0 else "win"


def kinds_row(cell):
    plain = trace_cells.plain_steps(cell)
    spent = collections.defaultdict(lambda: [0, 0.0, 0.0])  # kind -> steps, seconds, as plain steps
    for step in (s for s in cell["steps"] if s["k"]):
        row = spent[kind(step)]
        row[0] += 1
        row[1] += step["total_s"]
        row[2] += step["emitted"] / step["rows"] * plain.get(step["rows"], float("nan"))
    shown = " | ".join("%d: %.1f (%.1f)" % tuple(spent[k]) for k in ("probe", "win", "unpriced"))
    fill_s = sum(c["s"] for c in cell["catch_ups"])
    busy = trace_cells.busy_s(trace_cells.summary(cell))
    return f"| {cell['level']} | {cell['method']} | {cell['repeat'] + 1} | {shown} | {fill_s:.1f} | {busy:.1f} |"


def priced_against_run(cell):
    """By rows: the wins' tokens and seconds as priced (chains of the choice's k at each row's rate) and as run."""
    by_rows = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for step in (s for s in cell["steps"] if s["k"] and kind(s) == "win"):
        choice, k = step["choice"], step["choice"]["k"]
        tokens = sum(chain_tokens(a, k) for a in choice["rates"]) + step["rows"] - len(choice["rates"])
        row = by_rows[step["rows"]]
        row[0] += 1
        row[1] += tokens / choice["pred"][k]
        row[2] += tokens
        row[3] += step["total_s"]
        row[4] += step["emitted"]
    return {rows: (n, tokens / seconds, emitted / run_s) for rows, (n, seconds, tokens, run_s, emitted) in by_rows.items()}


def main():
    trace = [json.loads(line) for line in open(sys.argv[1])]
    cells = [c for c in trace_cells.cells_of(trace, *trace_cells.run_args(sys.argv[2:])) if c["mode"] == "on"]
    print("| c | method | repeat | probes: steps: s (as plain) | wins | unpriced | filling s | busy s |")
    print("|---|---|---|---|---|---|---:|---:|")
    for cell in cells:
        print(kinds_row(cell))
    print()
    print("| c | method | repeat | rows | wins | tok/s priced | tok/s run |")
    print("|---|---|---|---:|---:|---:|---:|")
    for cell in cells:
        for rows, (n, priced, run) in sorted(priced_against_run(cell).items()):
            print(f"| {cell['level']} | {cell['method']} | {cell['repeat'] + 1} | {rows} | {n} | {priced:.1f} | {run:.1f} |")


if __name__ == "__main__":
    main()
