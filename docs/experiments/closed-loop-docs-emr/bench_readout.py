"""`draftwise bench` with the compact draft's readout over the lowest N ids instead of 32,768 (no option sets it).

    .venv/bin/python bench_readout.py N bench --dtype gguf ...

A record's script, not part of the library."""
import inspect, sys
import draftwise.loading as loading
from draftwise.cli import main
keep = int(sys.argv[1])
names = [p for p, v in inspect.signature(loading.assemble).parameters.items() if v.default is not inspect.Parameter.empty]
defaults = list(loading.assemble.__defaults__); defaults[names.index("draft_vocab")] = keep
loading.assemble.__defaults__ = tuple(defaults)
sys.exit(main(sys.argv[2:]))
