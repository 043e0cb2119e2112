"""What the quant kernel's attention (qgemm.attention, the stack's dw_attention) costs a layer and a forward, for the
Qwen2.5-Coder 1.5B's heads (12 on 2, d 128, 28 layers) and the 0.5B's (14 on 2, d 64, 24 layers), by keys in the
cache and query tokens, on random inputs:

    .venv/bin/python docs/experiments/tools/attention_widths.py

Each cell is the mean of 50 calls after one warm call; run it once per version of qgemm.c to compare two."""
import time

import torch

from draftwise.backends.qgemm import attention


def timed(call, calls: int = 50) -> float:
    call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    for name, heads, kv_heads, dim, layers in (("1.5B", 12, 2, 128, 28), ("0.5B", 14, 2, 64, 24)):
        for keys in (128, 512, 1450, 3000):
            for n in (1, 5):
                q = torch.randn(1, heads, n, dim)
                k, v = torch.randn(1, kv_heads, keys, dim), torch.randn(1, kv_heads, keys, dim)
                visible = torch.ones(1, n, keys, dtype=torch.uint8)
                ms = timed(lambda: attention(q, k, v, visible, dim ** -0.5))
                print(f"{name} keys={keys} n={n}: {ms:.3f} ms a layer, {ms * layers:.1f} ms a forward")


if __name__ == "__main__":
    main()
