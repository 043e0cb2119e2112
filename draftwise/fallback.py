"""The server's fallback: a proposer that raises (or, with a draft timeout, drafts too slowly) is dropped and its
sequence goes on with the target alone, still exact. Off (the library's default), a proposer's error ends the
request, so that a caller sees what went wrong."""
from __future__ import annotations

from dataclasses import dataclass

from draftwise.proposers.base import Proposer
from draftwise.sequence import Sequence
from draftwise.types import Draft


@dataclass
class Fallback:
    own_proposer: Proposer | None  # the engine's own, which serves sequence after sequence and is never released
    on_proposer_error: bool = False
    draft_timeout_s: float | None = None

    def drop(self, seq: Sequence, err: BaseException) -> None:
        """The sequence goes on with the target alone (its proposer's caches were settled by its round)."""
        if seq.proposer is not self.own_proposer:
            seq.proposer.release()
        seq.proposer, seq.acceptance = None, None
        seq.stats.fallback = f"{type(err).__name__}: {err}"

    def where_drafting_failed(self, seqs: list[Sequence], drafts: list, ks: list[int],
                              draft_s: float) -> list[Sequence]:
        """With fallback on: a sequence whose proposer raised takes this round with an empty draft and the rest
        without a proposer. Returns the sequences that drafted in a step slower than the draft timeout: their
        drafts were good and are used, and drop_slow drops them once the round is committed."""
        if not self.on_proposer_error:
            return []
        for i, seq in enumerate(seqs):
            if isinstance(drafts[i], BaseException):
                self.drop(seq, drafts[i])
                drafts[i], ks[i] = Draft(token_ids=()), 0
        slow = self.draft_timeout_s is not None and draft_s > self.draft_timeout_s
        return [seq for seq, k in zip(seqs, ks) if slow and k > 0]

    def drop_slow(self, seqs: list[Sequence], draft_s: float) -> None:
        for seq in seqs:
            self.drop(seq, TimeoutError(f"drafting took {1000 * draft_s:.0f} ms, over the "
                                        f"{1000 * self.draft_timeout_s:.0f} ms limit"))
