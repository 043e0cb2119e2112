"""The engine's metrics (docs/serving.md lists them), counted in one place and named once."""
from __future__ import annotations

from dataclasses import dataclass, field

from draftwise import planner


@dataclass
class Stats:
    method: str
    num_draft_tokens: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    nodes: int = 0  # draft tokens scored: `proposed` for chains; for a token tree every node, its depth in `proposed`
    rounds: int = 0
    target_forwards: int = 0  # decode passes of the target (prefill apart)
    proposed_at: list[int] = field(default_factory=list)  # [k]: rounds that offered a token at position i
    accepted_at: list[int] = field(default_factory=list)  # [k]: rounds that kept the token at position i
    # per_position_acceptance[i] = accepted_at[i] / proposed_at[i]: among rounds that offered an i-th token.
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    decode_s: float = 0.0  # time spent decoding (rounds and emission), the caller's time between events excluded
    speed_paths: dict = field(default_factory=dict)  # what load chose: dtype, kernels per model, draft vocabulary
    prompt_cached: int = 0  # prompt tokens restored from the prompt cache instead of prefilled
    fallback: str | None = None  # why the proposer was dropped mid-request (the server's fallback), if it was
    forced_tokens: int = 0  # tokens a grammar forced, drafted by no model and kept (not in proposed/accepted)

    def observe_draft(self, num_draft: int, num_accepted: int, nodes: int | None = None) -> None:
        """Count one verification round: num_draft tokens offered, the first num_accepted kept. A tree offers
        num_draft positions (its depth, so acceptance reads by depth) with `nodes` tokens in all."""
        self.rounds += 1
        self.target_forwards += 1
        self.proposed += num_draft
        self.nodes += num_draft if nodes is None else nodes
        self.accepted += num_accepted
        grow = num_draft - len(self.proposed_at)
        if grow > 0:
            self.proposed_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(num_draft):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < num_accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per target pass, the target's own token included (as vLLM and EAGLE count)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else None

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.decode_s - self.draft_s - self.verify_s)

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else None

    @property
    def cost_ratio(self) -> float | None:
        """c: seconds per proposed token over seconds per target pass, both measured in this run."""
        if not self.proposed or not self.target_forwards or self.verify_s <= 0:
            return None
        return (self.draft_s / self.proposed) / (self.verify_s / self.target_forwards)

    @property
    def predicted_speedup(self) -> float | None:
        """Leviathan et al.'s prediction over this run's rounds as they were drafted (leviathan_over_rounds)."""
        return leviathan_over_rounds(self.acceptance_rate, self.cost_ratio, self.rounds, self.proposed_at)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "num_draft_tokens": self.num_draft_tokens,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "nodes": self.nodes,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "per_position_acceptance": self.per_position_acceptance,
            "rounds": self.rounds,
            "target_forwards": self.target_forwards,
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "overhead_s": self.overhead_s,
            "decode_s": self.decode_s,
            "tokens_per_s": self.tokens_per_s,
            "cost_ratio": self.cost_ratio,
            "predicted_speedup": self.predicted_speedup,
            "speed_paths": self.speed_paths,
            "prompt_cached": self.prompt_cached,
            "fallback": self.fallback,
            "forced_tokens": self.forced_tokens,
        }


def leviathan_speedup(a: float | None, k: float | None, c: float | None) -> float | None:
    """Leviathan et al.: a round that offers k tokens, each kept with chance a, yields 1 + a + ... + a^k tokens for
    the time of 1 + k c target steps: (1 - a^(k+1)) / ((1 - a)(k c + 1)); (k + 1) / (k c + 1) when a == 1. The
    round planner's rate in target steps (planner.leviathan_speedup)."""
    if a is None or k is None or c is None:
        return None
    return planner.leviathan_speedup(a, k, c)


def leviathan_over_rounds(a: float | None, c: float | None, rounds: int, offered_at: list[int]) -> float | None:
    """The same prediction summed over rounds that offered different k (adaptive k; a plain step where lookup found
    no match or drafting did not pay): offered_at[i] rounds offered an (i+1)-th token, so offered_at[k-1] -
    offered_at[k] offered exactly k; their expected tokens over their steps, each round priced by the planner in
    target steps. Equal to leviathan_speedup when every round offers k; the mean k put into that formula instead
    would credit the plain steps with part of the drafted rounds' gain (it is concave in k)."""
    if a is None or c is None or not rounds:
        return None
    offering = [more - fewer for more, fewer in zip([rounds, *offered_at], [*offered_at, 0])]  # [k]: rounds of k
    steps = planner.FlatPrices(draft_s=c)
    tokens = sum(n * planner.chain_tokens(a, k) for k, n in enumerate(offering))
    seconds = sum(n * planner.round_seconds(steps, 1, k, k) for k, n in enumerate(offering))
    return tokens / seconds
