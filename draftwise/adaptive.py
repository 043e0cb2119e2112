"""How many tokens to draft next round: the k that maximizes expected tokens per second.

Speculation pays only when the tokens a round is expected to emit outweigh what the round costs, and both
sides move: acceptance changes with the text (a copied span, then free prose), and the cost of a
verification pass depends on its width, the dtype and the machine (in float32 on CPU, verifying 5 tokens
costs about two plain steps; in bfloat16 about one). So both are measured as the generation goes:

- acceptance `a`: the maximum-likelihood per-token rate of a geometric run (kept tokens over kept tokens
  plus rejections), decayed so that recent rounds count most;
- seconds per draft token, and seconds per verification pass of each width n = k + 1, decayed the same way.

A round of k tokens is expected to emit (1 - a^(k+1)) / (1 - a) tokens (Leviathan et al.) and to cost
k * draft + verify(k + 1) seconds; k = 0 is a plain step. A width never measured is interpolated between
the nearest measured ones, or costs what the nearest does (optimism, so that wider drafts get tried). When k = 0 wins,
every PROBE_EVERY-th round still drafts one token, so a text that turns copyable is noticed.

The choice never touches exactness: any k, chosen before the round from the past alone, keeps the output
the target's own (greedy) or its distribution (sampling).
"""
from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.9  # weight of the past in every running estimate, per round
PROBE_EVERY = 8
MAX_STOP_CONFIDENCE = 0.5
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0  # a = 0.5 before any evidence, worth two tokens of it


def interpolate(table: dict[int, float], n: float) -> float:
    """table[n] if measured, else linear between the nearest measured widths, else the nearest one's value."""
    if n in table:
        return table[n]
    below = max((w for w in table if w < n), default=None)
    above = min((w for w in table if w > n), default=None)
    if below is None or above is None:
        return table[below if above is None else above]
    share = (n - below) / (above - below)
    return (1 - share) * table[below] + share * table[above]


def expected_tokens(a: float, k: int) -> float:
    """Tokens a round of k draft tokens emits on average, the target's own included."""
    return k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class DraftLengthController:
    k_max: int
    _accepted: float = PRIOR_ACCEPTED
    _trials: float = PRIOR_TRIALS
    _verify_s: dict[int, float] = field(default_factory=dict)  # width n -> seconds per verification pass
    _draft_s: float | None = None
    _rounds_without_draft: int = 0

    @property
    def acceptance(self) -> float:
        return self._accepted / self._trials

    def choose(self) -> int:
        """k in [0, k_max] that maximizes expected tokens per second under the current estimates."""
        if not self._verify_s:
            return self.k_max  # nothing measured yet: try the full width
        best = max(range(self.k_max + 1), key=self.rate)
        if best == 0:
            self._rounds_without_draft += 1
            if self._rounds_without_draft % PROBE_EVERY == 0:
                return 1
        return best

    def rate(self, k: int) -> float:
        """Expected tokens per second of a round that drafts k tokens."""
        draft_s = (self._draft_s or 0.0) * k
        return expected_tokens(self.acceptance, k) / (draft_s + self.verify_cost(k + 1))

    def verify_cost(self, n: int) -> float:
        return interpolate(self._verify_s, n)

    def stop_confidence(self) -> float:
        """Below this draft confidence a draft token is not worth its step: its chance of being kept (which the
        draft's own probability approximates) is smaller than what it costs, as a share of a verification pass."""
        if self._draft_s is None or not self._verify_s:
            return 0.0
        return min(MAX_STOP_CONFIDENCE, self._draft_s / self.verify_cost(2))

    def observe(self, num_draft: int, num_accepted: int, draft_s: float, verify_s: float) -> None:
        """One round: num_draft offered, the first num_accepted kept, and what drafting and verifying took."""
        if num_draft > 0:
            rejected = 1 if num_accepted < num_draft else 0
            self._accepted = DECAY * self._accepted + num_accepted
            self._trials = DECAY * self._trials + num_accepted + rejected
            per_token = draft_s / num_draft
            self._draft_s = per_token if self._draft_s is None else DECAY * self._draft_s + (1 - DECAY) * per_token
        n = num_draft + 1
        old = self._verify_s.get(n)
        self._verify_s[n] = verify_s if old is None else DECAY * old + (1 - DECAY) * verify_s
