"""Passes of the 1.5B and the 0.5B on the quant backend, two kernel builds alternating every round in one process:
qgemm.c at OLD_REV (default HEAD) against the working tree's. Median ms of a forward of n tokens after ctx tokens."""
import os, statistics, subprocess, sys, tempfile, time
from pathlib import Path
import draftwise.backends.qgemm as qg
import draftwise.backends.quant_stack as qs
import draftwise.backends.quant_layers as ql
from draftwise import Engine
from draftwise.backends.hf import HFBackend

old_src = Path(tempfile.gettempdir()) / "qgemm_old.c"
old_src.write_bytes(subprocess.run(["git", "show", os.environ.get("OLD_REV", "HEAD") + ":draftwise/backends/qgemm.c"], capture_output=True, check=True).stdout)
new_lib = qg.library()
isa = new_lib.isa
saved = qg.SOURCE
qg.SOURCE = old_src
old_lib = qg.library_for.__wrapped__(isa)
qg.SOURCE = saved
libs = {"old": old_lib, "new": new_lib}
def use(lib):
    qs.library = ql.library = qg.library = lambda: lib
eng = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", method="draft",
                             backend="auto", progress=False)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 12
print(f"kernel path {isa}; {rounds} rounds", flush=True)
for label, model, widths in (("draft", eng.proposer.backend.model, (1,)), ("target", eng.target.model, (1, 2, 4, 8))):
    for ctx in (200, 1500):
        prompt = [(7 * i + 3) % 1000 for i in range(ctx + 8)]
        b = HFBackend(model)
        b.prefill(prompt[:ctx])
        times = {(name, n): [] for name in libs for n in widths}
        for r in range(rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                use(libs[name])
                for n in widths:
                    t = time.perf_counter(); b.forward(prompt[ctx:ctx + n]); times[name, n].append(time.perf_counter() - t)
                    b.trim(ctx)
        for n in widths:
            o, w = statistics.median(times["old", n]) * 1e3, statistics.median(times["new", n]) * 1e3
            print(f"{label} ctx {ctx} n {n}: old {o:.2f} ms, new {w:.2f} ms, new/old {w / o:.3f}", flush=True)
