"""`make demo`: the default pair, streamed with draft tokens marked, then the same prompt through the
target alone, prompt lookup and the hybrid, to show the speed-up and that the greedy text is unchanged; and, for
scale, llama.cpp (llama-cpp-python, installed beside draftwise) decoding the same GGUF file alone, greedy, on the
same threads: what a CPU user would run instead.

`--backend auto` (the default) runs the GGUF files' own 4- and 6-bit blocks on draftwise's integer kernel where
this CPU has AVX512-VNNI (the quant backend), and transformers' weights in --dtype elsewhere.
`--dtype auto` (the default) is bfloat16 where the hardware computes it and float32 elsewhere. Where a
bfloat16 text differs from the target alone, the demo shows the first differing position and the target's
top-2 logit gap there: a rounding near-tie, not a bug (README, "What it guarantees").
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from draftwise import Engine
from draftwise.cli import fmt_optional, stats_line, stream_to_terminal
from draftwise.config import DTYPES
from draftwise.errors import DraftwiseError
from draftwise.loading import QUANT_ASSEMBLY, auto_backend, load_models
from draftwise.models.store import resolve
from draftwise.tokenizers import encode_prompt

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPT, NEW_TOKENS, K = "def quicksort(arr):", 128, 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stream a speculative generation, then compare it with the "
                                                 "target alone, prompt lookup and the hybrid.")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="weights dtype on the hf backend "
                                                                        "(default: %(default)s)")
    parser.add_argument("--backend", choices=("auto", "hf", "quant"), default="auto",
                        help="auto: quant where this CPU runs its kernel, else hf (default: %(default)s)")
    args = parser.parse_args(argv)
    print(f"loading {TARGET} (target) and {DRAFT} (draft); the first run pulls them", file=sys.stderr)
    backend = auto_backend(TARGET, DRAFT, "hybrid", dtype=args.dtype) if args.backend == "auto" else args.backend
    quantized = backend == "quant"
    options = QUANT_ASSEMBLY if quantized else {}
    print(f"backend {backend}", file=sys.stderr)
    target_model, tokenizer, draft_model, _ = load_models(TARGET, DRAFT, "float32" if quantized else args.dtype,
                                                          quantized=quantized)
    speculative = Engine.from_models(target_model, tokenizer, draft_model=draft_model, **options)
    del target_model  # the engine runs a copy on faster kernels; the loaded original is not needed again
    print(f"\n--- method draft, k={K}, greedy; draft tokens in green on a terminal ---", file=sys.stderr)
    result = stream_to_terminal(speculative, PROMPT, color=sys.stdout.isatty(), max_new_tokens=NEW_TOKENS, num_draft_tokens=K)
    print(stats_line(result.stats), file=sys.stderr)

    # The same loaded models for the other methods: no second load, no second plan of the target's kernels.
    rows = [("draft", result)]
    for method in ("none", "lookup", "hybrid"):
        draft = draft_model if method == "hybrid" else None
        engine = Engine.from_models(speculative.target.model, tokenizer, draft_model=draft, method=method, **options)
        rows.append((method, engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=K)))
    baseline = rows[1][1]
    print_table(rows, baseline)
    print_llama_cpp(encode_prompt(tokenizer, PROMPT, chat=False), rows)
    different = [(method, r) for method, r in rows if r.token_ids != baseline.token_ids]
    for method, r in different:
        explain_difference(method, r.token_ids, baseline.token_ids, speculative, tokenizer)
    print("greedy identity:", "yes" if not different else "NO", file=sys.stderr)
    return 0 if not different else 1


def print_table(rows, baseline) -> None:
    # ms/pass: a target pass over k+1 tokens costs more than a 1-token step (how much depends on dtype and
    # kernels), which the Leviathan prediction, made from c alone, does not see.
    print("\nmethod  tokens/s  speedup  acceptance  mean accepted  target passes  ms/pass  c      predicted  same as none",
          file=sys.stderr)
    for method, r in rows:
        s = r.stats
        print(
            f"{method:7} {s.tokens_per_s:8.2f}  {s.tokens_per_s / baseline.stats.tokens_per_s:6.2f}x  "
            f"{fmt_optional(s.acceptance_rate, '.1%'):>10}  {s.mean_accepted_length:13.2f}  {s.target_forwards:13d}  "
            f"{1000 * s.verify_s / s.target_forwards:7.0f}  {fmt_optional(s.cost_ratio, '.3f'):5}  {fmt_optional(s.predicted_speedup, '.2f', 'x'):>9}  {r.token_ids == baseline.token_ids}",
            file=sys.stderr,
        )
    print(f"backend {baseline.stats.speed_paths.get('backend')}, dtype {baseline.stats.speed_paths.get('dtype')}; kernels: target {baseline.stats.speed_paths.get('target_kernels')}, "
          f"draft {rows[0][1].stats.speed_paths.get('draft_kernels')}", file=sys.stderr)


def print_llama_cpp(prompt_ids: list[int], rows) -> None:
    """llama.cpp's plain greedy decoding of the target's own GGUF file, timed as draftwise's tokens/s (decode only),
    and each method's speed against it."""
    try:
        from draftwise.backends.llamacpp_api import LlamaContext, LlamaSettings

        gguf = resolve(TARGET, pull_missing=False).published_gguf(TARGET, "llama.cpp")
        # llama.cpp's defaults (its repacked weights), on the threads torch uses here
        context = LlamaContext(str(gguf), 1, len(prompt_ids) + NEW_TOKENS + 8,
                               LlamaSettings(threads=torch.get_num_threads(), repack=True))
    except DraftwiseError as err:
        print(f"\nllama.cpp not compared: {err}", file=sys.stderr)
        return
    try:
        logits = context.decode(prompt_ids, list(range(len(prompt_ids))), [0] * len(prompt_ids),
                                [False] * (len(prompt_ids) - 1) + [True])
        tokens = [int(logits[-1].argmax())]
        start = time.perf_counter()
        while len(tokens) < NEW_TOKENS:
            logits = context.decode(tokens[-1:], [len(prompt_ids) + len(tokens) - 1], [0], [True])
            tokens.append(int(logits[-1].argmax()))
        rate = (NEW_TOKENS - 1) / (time.perf_counter() - start)
    finally:
        context.close()
    baseline = dict(rows)["none"].token_ids
    agree = next((i for i, (a, b) in enumerate(zip(tokens, baseline)) if a != b), NEW_TOKENS)
    ratios = ", ".join(f"{method} {r.stats.tokens_per_s / rate:.2f}x" for method, r in rows)
    same = "the same text as none" if agree == NEW_TOKENS else \
        f"its text leaves none's at new token {agree} (its kernels round otherwise)"
    print(f"\nllama.cpp on the same GGUF file, no speculation: {rate:.2f} tokens/s, {same}; against it: {ratios}",
          file=sys.stderr)


def explain_difference(method: str, tokens: list[int], baseline: list[int], engine: Engine, tokenizer) -> None:
    """Where method's text leaves the target's own, and how close the target's two best tokens were there."""
    at = next(i for i, (a, b) in enumerate(zip([*tokens, None], [*baseline, None])) if a != b)
    logits = next_token_logits(engine, [*encode_prompt(tokenizer, PROMPT, chat=False), *baseline[:at]])  # [vocab]
    top = torch.topk(logits, 2)
    first, second = (tokenizer.decode([int(i)]) for i in top.indices)
    print(f"{method} differs from none at new token {at}: the target's top two there are {first!r} "
          f"({top.values[0]:.4f}) and {second!r} ({top.values[1]:.4f}), a gap of {top.values[0] - top.values[1]:.4f}; "
          f"a gap within the dtype's rounding is a near-tie, not a bug", file=sys.stderr)


def next_token_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    engine.target.prefill(ids[:-1])
    return engine.target.forward(ids[-1:])[0]  # [vocab]


if __name__ == "__main__":
    sys.exit(main())
