"""`make demo`: the default pair, streamed with draft tokens marked, then the same prompt through the
target alone and through prompt lookup, to show the speed-up and that the greedy text is unchanged."""
from __future__ import annotations

import sys

from draftwise import Engine
from draftwise.cli import stats_line, stream_to_terminal

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

    print("\nmethod   tokens/s  acceptance  mean accepted  target passes  same text as none", file=sys.stderr)
    baseline = rows[1][1]
    for method, r in rows:
        s = r.stats
        acceptance = f"{s.acceptance_rate:.1%}" if s.acceptance_rate is not None else "-"
        print(
            f"{method:8} {s.tokens_per_s:8.2f}  {acceptance:>10}  {s.mean_accepted_length:13.2f}  "
            f"{s.target_forwards:13d}  {r.token_ids == baseline.token_ids}",
            file=sys.stderr,
        )
    same = all(r.token_ids == baseline.token_ids for _, r in rows)
    print("greedy identity:", "yes" if same else "NO", file=sys.stderr)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
