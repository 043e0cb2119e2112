"""Verify a whole batch's drafts at once: flat draft ids with per-sequence offsets (as vLLM's rejection sampler
takes them), every sequence judged by its own sampling settings and random generator.

The scalar verifiers (greedy.py, rejection.py) stay the oracle: for the same logits and generator states this
returns exactly their verdicts, drawing the same random numbers in the same order, which the tests check.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from draftwise.config import SamplingConfig
from draftwise.sampling import argmax_ids, logits_to_probs, sample
from draftwise.types import Draft, TreeLayout, Verdict
from draftwise.verify.rejection import _residual
from draftwise.verify.tree import verify_tree_greedy, verify_tree_sampled


@dataclass(frozen=True)
class DraftBatch:
    token_ids: torch.Tensor  # [T] long: every sequence's draft, concatenated
    offsets: tuple[int, ...]  # [B + 1]: sequence b's draft is token_ids[offsets[b] : offsets[b + 1]]
    q: tuple[torch.Tensor | None, ...]  # per sequence [n_b, vocab], None for a one-hot (or greedy) draft
    layouts: tuple[TreeLayout | None, ...] = ()  # per sequence: its tree's layout, None for a chain

    @classmethod
    def of(cls, drafts: list[Draft]) -> "DraftBatch":
        offsets = [0]
        for draft in drafts:
            offsets.append(offsets[-1] + len(draft))
        ids = [t for draft in drafts for t in draft.token_ids]
        return cls(torch.tensor(ids, dtype=torch.long), tuple(offsets), tuple(d.q for d in drafts),
                   tuple(d.layout for d in drafts))

    def rows(self, b: int) -> slice:
        """Sequence b's rows in the flat logits: one per draft token, plus one after them ([n_b + 1])."""
        return slice(self.offsets[b] + b, self.offsets[b + 1] + b + 1)


def verify_batch(batch: DraftBatch, logits: torch.Tensor, samplings: list[SamplingConfig],
                 generators: list[torch.Generator], drawn: list[list[int] | None] | None = None) -> list[Verdict]:
    """logits: [T + B, vocab], sequence b's rows at batch.rows(b). Returns one Verdict per sequence. drawn: per
    sequence, the target's own token at each of its rows where it drew them from shared noise (shared_noise.py), else
    None: such a row is verified as a greedy one is, against those tokens in place of the argmax."""
    drawn = drawn or [None] * len(samplings)
    greedy_ids = argmax_ids(logits) if any(s.greedy for s in samplings) else None  # [T + B]
    verdicts = []
    for b, (sampling, generator) in enumerate(zip(samplings, generators)):
        draft = batch.token_ids[batch.offsets[b] : batch.offsets[b + 1]]  # [n_b]
        own = drawn[b] if drawn[b] is not None else greedy_ids[batch.rows(b)] if sampling.greedy else None
        if batch.layouts and batch.layouts[b] is not None:
            verdicts.append(_tree(tuple(draft.tolist()), batch.layouts[b], logits[batch.rows(b)],
                                  sampling, generator, own))
        elif own is not None:
            verdicts.append(_greedy(draft.tolist(), own))
        else:
            p = logits_to_probs(logits[batch.rows(b)], sampling)  # [n_b + 1, vocab]
            verdicts.append(_rejection(draft, batch.q[b], p, generator))
    return verdicts


def _tree(draft: tuple[int, ...], layout: TreeLayout, logits: torch.Tensor, sampling: SamplingConfig,
          generator: torch.Generator, greedy_ids: list[int] | None) -> Verdict:
    if greedy_ids is not None:
        return verify_tree_greedy(draft, layout, greedy_ids)
    return verify_tree_sampled(draft, layout, logits_to_probs(logits, sampling), generator)  # p: [n_b + 1, vocab]


def _greedy(draft: list[int], target_ids: list[int]) -> Verdict:
    accepted = next((i for i, (d, t) in enumerate(zip(draft, target_ids)) if d != t), len(draft))
    return Verdict(num_accepted=accepted, next_token=target_ids[accepted])


def _rejection(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator) -> Verdict:
    n = len(draft)
    uniforms = torch.rand(n, generator=generator)  # [n], drawn up front as the scalar verifier does
    p_draft = _at_draft(p, draft)  # [n]
    q_draft = torch.ones(n) if q is None else _at_draft(q, draft)  # [n]
    rejected = (uniforms.double() * q_draft.double() >= p_draft.double()).nonzero()
    if len(rejected) == 0:
        return Verdict(num_accepted=n, next_token=sample(p[n], generator))
    i = int(rejected[0])
    return Verdict(num_accepted=i, next_token=sample(_residual(p[i], q, i, int(draft[i])), generator))


def _at_draft(probs: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """probs[i, draft[i]] for each position, [n], on the CPU: gathered where probs live (a GPU's rows stay
    there), compared where the generator's uniforms are."""
    positions = torch.arange(len(draft), device=probs.device)
    return probs[positions, draft.to(probs.device)].cpu()
