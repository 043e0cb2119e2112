"""What a draft learns from served traffic: the proposal logs' finished requests, each prompt with the target's own
output (the server computed it while serving: no target pass is needed to learn from it), split by time.

Why by time: a draft is put in front of the traffic that comes after what it learnt from, so it is judged on the
latest requests, never on a random sample of the same ones (the split a service's drift would make look too good).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftwise.errors import DraftwiseError
from draftwise.serve.proposal_log import connect

# The target's own text however it ended (a cancelled request's too); never "error" (its proposer failed, and the
# text may stop anywhere) or "content_filter" (the guard's: never trained on).
USABLE_FINISHES = ("eos", "stop", "length", "cancelled")
MIN_TRAIN, MIN_HELD_OUT = 8, 2  # requests: fewer teach nothing a measurement could see


@dataclass(frozen=True)
class Served:
    request_id: str
    ts: float  # when it finished
    ids: list[int]  # the prompt, then the target's output
    answer_start: int  # where the output starts

    @property
    def answer_tokens(self) -> int:
        return len(self.ids) - self.answer_start


@dataclass(frozen=True)
class Span:
    """Which requests a split holds, for a draft's provenance."""

    requests: int
    tokens: int  # output tokens
    first_ts: float | None
    last_ts: float | None

    @classmethod
    def of(cls, served: list[Served]) -> "Span":
        return cls(len(served), sum(s.answer_tokens for s in served), served[0].ts if served else None,
                   served[-1].ts if served else None)


def served_requests(paths: list[str | Path]) -> list[Served]:
    """Every finished request with output in the logs at paths, oldest first (a request in two logs, once)."""
    found: dict[str, Served] = {}
    for path in paths:
        db = connect(Path(path))
        try:
            rows = db.execute("SELECT request_id, ts, prompt_ids, output_ids FROM requests WHERE finish IN "
                              f"({', '.join('?' * len(USABLE_FINISHES))})", USABLE_FINISHES).fetchall()
        finally:
            db.close()
        for request_id, ts, prompt, output in rows:
            prompt_ids, output_ids = json.loads(prompt), json.loads(output)
            if output_ids:
                found[request_id] = Served(request_id, ts, prompt_ids + output_ids, len(prompt_ids))
    return sorted(found.values(), key=lambda s: (s.ts, s.request_id))


def time_split(served: list[Served], held_out_share: float) -> tuple[list[Served], list[Served]]:
    """(the earlier requests to learn from, the latest held_out_share of them to judge on), or a DraftwiseError that
    says how much more traffic is needed."""
    if not 0 < held_out_share < 1:
        raise DraftwiseError(f"--held-out must be between 0 and 1 (a share of the requests), got {held_out_share}")
    held_out = max(MIN_HELD_OUT, round(held_out_share * len(served)))
    if len(served) - held_out < MIN_TRAIN:
        raise DraftwiseError(
            f"the log holds {len(served)} finished requests with output; distilling needs at least "
            f"{MIN_TRAIN + MIN_HELD_OUT} ({MIN_TRAIN} to learn from, the latest {MIN_HELD_OUT} or more held out): "
            f"serve more traffic with --proposal-log")
    return served[:-held_out], served[-held_out:]


def window(item: Served, seq_len: int) -> tuple[list[int], int]:
    """At most seq_len tokens of the request, and where its output starts in them: the output with as much of the
    prompt before it as fits, or, for an output longer than seq_len, its first tokens after a quarter of context."""
    ids, start = item.ids, item.answer_start
    if len(ids) <= seq_len:
        return ids, start
    # (strictly before the output: its first token is read at the token before it)
    begin = len(ids) - seq_len if len(ids) - seq_len < start else max(0, start - seq_len // 4)
    return ids[begin : begin + seq_len], start - begin
