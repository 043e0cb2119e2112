"""Times dw_attention of two builds of qgemm.c, interleaved: one layer's attention of the 1.5B's shapes (12 or 14
query heads on 2 key heads, d 128) for a causal prefill, a served prefill chunk, a decode step and a verification.

    git show d9de61b^:draftwise/backends/qgemm.c > /tmp/old.c
    python docs/experiments/prefill-attention-zen5/attn_bench.py /tmp/old.c draftwise/backends/qgemm.c avx512,avx2
"""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from draftwise.backends import qgemm
from test_kernel_isa import attention_on

WORK = Path(tempfile.mkdtemp())


def build(src, tag, isa):
    out = str(WORK / f"{tag}-{isa}.so")
    subprocess.run([qgemm.compiler(), *qgemm.build_flags(isa), "-o", out, src, "-lm"], check=True)
    return qgemm.open_library(out, isa)

def case(heads, n, past, dim=128):
    keys = past + n
    q = torch.randn(1, heads, n, dim); k = torch.randn(1, 2, keys, dim); v = torch.randn(1, 2, keys, dim)
    vis = torch.ones(keys, keys, dtype=torch.uint8).tril()[past:].unsqueeze(0).contiguous()
    return q, k, v, vis, dim ** -0.5

def main():
    old_source, new_source = sys.argv[1], sys.argv[2]
    isas = sys.argv[3].split(",") if len(sys.argv) > 3 else ["avx512"]
    cases = {"prefill 1450 (12h)": case(12, 1450, 0), "prefill 1450 (14h)": case(14, 1450, 0),
             "prefill 512 (12h)": case(12, 512, 0),
             "chunk 128 at 1322": case(12, 128, 1322), "decode 1 at 1450": case(12, 1, 1450),
             "verify 5 at 1450": case(12, 5, 1450)}
    for isa in isas:
        libs = {"old": build(old_source, "old", isa), "new": build(new_source, "new", isa)}
        for name, inputs in cases.items():
            reps = 3 if "prefill" in name else 40
            times = {k: [] for k in libs}
            outs = {}
            for r in range(reps):
                for tag, lib in libs.items():
                    t = time.perf_counter(); outs[tag] = attention_on(lib, *inputs); times[tag].append(time.perf_counter() - t)
            same = torch.equal(outs["old"], outs["new"])
            o, nw = statistics.median(times["old"]) * 1e3, statistics.median(times["new"]) * 1e3
            print(f"{isa:7s} {name:22s} old {o:9.2f} ms  new {nw:9.2f} ms  {o / nw:5.2f}x  same bits {same}", flush=True)

main()
