"""One request of a load run as the client saw it (RequestRecord), and the pure functions that fold its stream's
lines and chunks into it: what the tests feed made-up streams."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

ERROR_CHARS = 300  # how much of an error body a record keeps


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the request's own start unless said otherwise."""

    mode: str
    concurrency: int
    prompt_id: str
    method: str | None = None  # what was asked for (None: the server's own; off: the target alone)
    repeat: int = 0
    part: int = 0  # the slice of the cell's requests it ran in (LoadPlan.parts)
    start_s: float = 0.0  # from the start of the run
    ttft_s: float | None = None  # the first chunk with non-empty text
    chunk_times_s: list[float] = field(default_factory=list)  # every content chunk
    gaps_s: list[float] = field(default_factory=list)  # between consecutive content chunks
    total_s: float | None = None
    completion_tokens: int = 0
    tokens_from_usage: bool = False  # False: no usage chunk came, the content chunks were counted instead
    acceptance: float | None = None
    stats: dict | None = None  # the reply's `draftwise` field, as sent
    timings: dict | None = None  # llama-server's `timings` field, as sent (its draft_n, draft_n_accepted)
    seed: int | None = None  # what the request sent (None: greedy)
    finish_reason: str | None = None
    status: int | None = None  # the HTTP status
    done: bool = False  # the stream ended with data: [DONE]
    error: str | None = None
    level_wall_s: float | None = None  # the wall time of the run (a cell's slice in one repeat) it ran in


def finish_record(record: RequestRecord) -> None:
    """After the stream: a stream cut before [DONE] is a failure; without a usage chunk, llama-server's timings
    say how many tokens, else count the chunks (which undercounts a server that sends several tokens in one)."""
    if record.error is None and not record.done:
        record.error = "the stream ended before data: [DONE]"
    predicted = (record.timings or {}).get("predicted_n")
    if not record.tokens_from_usage:
        record.completion_tokens = int(predicted) if predicted is not None else len(record.chunk_times_s)


def time_per_token(record: RequestRecord) -> float | None:
    """TPOT: from the first chunk with text to the last, per token after the first. Unlike the gaps between
    chunks, it does not depend on how the server cuts its tokens into chunks; None under two tokens."""
    if record.completion_tokens < 2 or len(record.chunk_times_s) < 1:
        return None
    return (record.chunk_times_s[-1] - record.chunk_times_s[0]) / (record.completion_tokens - 1)


def draft_counts(record: RequestRecord) -> tuple[int, int] | None:
    """(proposed, accepted) draft tokens, from draftwise's stats or llama-server's timings; None without them."""
    if record.stats and record.stats.get("proposed"):
        return record.stats["proposed"], record.stats.get("accepted", 0)
    if record.timings and record.timings.get("draft_n"):
        return record.timings["draft_n"], record.timings.get("draft_n_accepted", 0)
    return None


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


STAT_NUMBERS = ("proposed", "accepted", "acceptance_rate", "mean_accepted_length")  # what the summary reads
TIMING_NUMBERS = ("predicted_n", "draft_n", "draft_n_accepted")  # llama-server's, likewise


def take_chunk(record: RequestRecord, chunk: dict, t: float) -> None:
    """Fold one OpenAI stream chunk (chat or completions), received t seconds into the request, into record. A
    chunk not of that shape is a ValueError (the request's "bad stream"), never another error that ends the run."""
    if not isinstance(chunk, dict):
        raise ValueError(f"a chunk must be a JSON object, got {chunk!r:.80}")
    try:
        _take(record, chunk, t)
    except (TypeError, AttributeError, KeyError) as err:
        raise ValueError(f"a chunk not in OpenAI's shape ({type(err).__name__}: {err}): {chunk!r:.80}") from None


def _take(record: RequestRecord, chunk: dict, t: float) -> None:
    if "error" in chunk:  # the server ended the request mid-stream
        error = chunk["error"]
        message = error.get("message") if isinstance(error, dict) else error
        record.error = f"error in stream: {message}"
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
        if text:
            if record.chunk_times_s:
                record.gaps_s.append(t - record.chunk_times_s[-1])
            else:
                record.ttft_s = t
            record.chunk_times_s.append(t)
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    usage = chunk.get("usage")
    if isinstance(usage, dict) and "completion_tokens" in usage:
        record.completion_tokens = int(usage["completion_tokens"])
        record.tokens_from_usage = True
    stats = chunk.get("draftwise")
    if isinstance(stats, dict):
        if any(not isinstance(stats.get(name, 0), (int, float, type(None))) for name in STAT_NUMBERS):
            raise TypeError(f"the draftwise stats hold a non-number among {', '.join(STAT_NUMBERS)}")
        record.stats = stats
        record.acceptance = stats.get("acceptance_rate")
    timings = chunk.get("timings")
    if isinstance(timings, dict):
        if any(not isinstance(timings.get(name, 0), (int, float)) for name in TIMING_NUMBERS):
            raise TypeError(f"the timings hold a non-number among {', '.join(TIMING_NUMBERS)}")
        record.timings = timings
        if timings.get("draft_n") and record.stats is None:
            record.acceptance = timings.get("draft_n_accepted", 0) / timings["draft_n"]


def http_error(status: int, body: bytes) -> str:
    """'HTTP 429: too many waiting requests': the OpenAI error message when the body has one, else the raw body."""
    text = body.decode("utf-8", "replace")
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text.strip() or "(empty body)"
    return f"HTTP {status}: {message[:ERROR_CHARS]}"
