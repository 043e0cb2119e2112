"""`make demo`: the default pair, streamed with draft tokens marked, then the same prompt through the
target alone and through prompt lookup, to show the speed-up and that the greedy text is unchanged."""
from __future__ import annotations

import sys

from draftwise import Engine
from draftwise.cli import fmt_optional, stats_line, stream_to_terminal

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPT, NEW_TOKENS, K = "def quicksort(arr):", 128, 4


def main() -> int:
    print(f"loading {TARGET} (target) and {DRAFT} (draft); the first run pulls them", file=sys.stderr)
    speculative = Engine.from_pretrained(target=TARGET, draft=DRAFT)
    print(f"\n--- method draft, k={K}, greedy; draft tokens in green on a terminal ---", file=sys.stderr)
    result = stream_to_terminal(speculative, PROMPT, color=sys.stdout.isatty(), max_new_tokens=NEW_TOKENS, num_draft_tokens=K)
    print(stats_line(result.stats), file=sys.stderr)

    # The same loaded target, alone and with prompt lookup: no second load.
    model, tokenizer = speculative.target.model, speculative.tokenizer
    rows = [("draft", result)]
    for method in ("none", "lookup"):
        engine = Engine.from_models(model, tokenizer, method=method)
        rows.append((method, engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, num_draft_tokens=K)))

    # ms/pass: a target pass over k+1 tokens costs more than a 1-token step (how much depends on dtype),
    # which the Leviathan prediction, made from c alone, does not see.
    print("\nmethod  tokens/s  speedup  acceptance  mean accepted  target passes  ms/pass  c      predicted  same as none",
          file=sys.stderr)
    baseline = rows[1][1]
    for method, r in rows:
        s = r.stats
        print(
            f"{method:7} {s.tokens_per_s:8.2f}  {s.tokens_per_s / baseline.stats.tokens_per_s:6.2f}x  "
            f"{fmt_optional(s.acceptance_rate, '.1%'):>10}  {s.mean_accepted_length:13.2f}  {s.target_forwards:13d}  "
            f"{1000 * s.verify_s / s.target_forwards:7.0f}  {fmt_optional(s.cost_ratio, '.3f'):5}  {fmt_optional(s.predicted_speedup, '.2f', 'x'):>9}  {r.token_ids == baseline.token_ids}",
            file=sys.stderr,
        )
    same = all(r.token_ids == baseline.token_ids for _, r in rows)
    print("greedy identity:", "yes" if same else "NO", file=sys.stderr)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
