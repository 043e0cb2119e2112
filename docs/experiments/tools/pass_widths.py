"""What a target pass over 1 to 16 new tokens costs, on the quant backend and on the hf backend (bfloat16).

    .venv/bin/python docs/experiments/tools/pass_widths.py [--target NAME] [--context 200] [--repeats 9]

Each backend's model loads once; for each width the pass runs after a context of --context tokens and is trimmed
off again, widths interleaved round by round; the median of --repeats rounds is printed, and its ratio to the
1-token step. Public API only: Engine.from_pretrained and the engine's target backend (open_slot, prefill,
forward, trim)."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftwise import Engine

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--backends", default="quant,hf")
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}, context {args.context}, median of {args.repeats}")
    for backend in args.backends.split(","):
        engine = Engine.from_pretrained(args.target, method="none", backend=backend, progress=False)
        slot = engine.target.open_slot()
        slot.prefill([(i * 7919) % 20000 + 100 for i in range(args.context)])
        times = {w: [] for w in WIDTHS}
        for _ in range(args.repeats + 1):  # the first round warms up
            for w in WIDTHS:
                start = time.perf_counter()
                slot.forward([(i * 104729) % 20000 + 100 for i in range(w)])
                times[w].append(time.perf_counter() - start)
                slot.trim(args.context)
        one = statistics.median(times[1][1:])
        cells = [f"{w}: {statistics.median(times[w][1:]) * 1e3:.1f} ms ({statistics.median(times[w][1:]) / one:.2f}x)"
                 for w in WIDTHS]
        print(f"{backend} ({engine.speed_paths.get('dtype')}): " + ", ".join(cells))
        slot.close()
        del engine


if __name__ == "__main__":
    main()
