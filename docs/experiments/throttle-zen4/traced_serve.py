"""Issue 58: `draftwise serve` with every engine step traced (step_trace.py), to see what a server's policy chose
where the in-process scheduler does not reproduce a loss. A step's cell is named by its rows: off (all `none`), on or
always (the adaptive flag of its drafting rows), and their methods.

.venv/bin/python docs/experiments/throttle-zen4/traced_serve.py TRACE.jsonl serve --port 8765 --method hybrid ..."""
import os, sys

sys.path.insert(0, os.path.dirname(__file__))
import step_trace  # noqa: E402
from draftwise.cli import main  # noqa: E402


def mode_of(engine, seqs):
    if not seqs:
        return None
    drafting = [s for s in seqs if s.method != "none"]
    if not drafting:
        return "off"
    kind = "on" if drafting[0].cfg.adaptive else "always"
    return kind + "-" + ",".join(sorted({s.method for s in drafting}))


step_trace.install(open(sys.argv[1], "w"), mode_of)
sys.exit(main(sys.argv[2:]))
