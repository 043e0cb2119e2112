"""`--capture-features DIR`: what a feature head learns from, kept as the target computes it while serving.

The head (proposers/feature_head.py) learns from the target's last hidden state at every position of a text and
the tokens around it (train/features.py's shards). A server computes exactly those while it serves: the prompt's
positions at prefill, and at each verification the positions it keeps (the text's last token and the accepted
draft tokens). Capturing them costs a copy of H numbers a position, not a pass: no target forward is needed to
train on served traffic.

The target's logits there are not kept beside them: they are the target's output layer applied to these
features (after its final norm, which they are taken after), so a trainer recomputes them exactly, at any top-k,
for a few kilobytes a position less.

The model thread only gathers a request's positions and, when it ends, puts the request on a bounded queue
(never blocking: a full queue drops the request, counted); a writer thread writes one file per request, whole or
not at all (files.write_whole), so a reader never sees half of one, and files are named by the time their request
ended, so the earliest are the first to go when the folder is past its size budget, and a time split is a split by
name. Like the proposal log, the files hold what users wrote (token ids decode to the text): folder 0700, files
0600.

A request counts only from its first position. A prompt restored from the prompt cache computes no features for
the restored part, so where the server has a prompt cache (attach_prompt_cache) each captured request's features go
there too, beside the target's keys and values under the name a head's take (prefix_cache.features_entry), and a
later request restored from it takes its prefix's features from there; one whose prefix's features the cache has
let go is not captured (`incomplete`). A request whose proposer or grammar forced tokens the target did not score
the same way keeps only the positions before them.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftwise.errors import DraftwiseError
from draftwise.files import write_whole

DEFAULT_QUEUE = 64  # requests waiting for the writer
PREFIX = "capture-"
ANSWERED = ("eos", "stop", "length")  # the finish reasons of a whole answer (types.Event)


class FeatureCapture:
    """Gathers each request's features on the model thread; writes them off it (module docstring)."""

    def __init__(self, folder: str | Path, max_bytes: int, queue_size: int = DEFAULT_QUEUE):
        if max_bytes < 1 or queue_size < 1:
            raise DraftwiseError("--capture-features-mb and the queue size must be >= 1")
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            os.chmod(self.folder, 0o700)
        except OSError as err:
            raise DraftwiseError(f"--capture-features {folder}: cannot make the folder ({err.strerror or err})") \
                from None
        self.max_bytes = max_bytes
        self.written = self.dropped = self.incomplete = 0
        self._parts: dict[object, list[tuple[int, torch.Tensor]]] = {}  # model thread only
        self._prompt_cache, self._entry = None, ""  # (attach_prompt_cache)
        self._queue: queue.Queue = queue.Queue(queue_size)
        self._writer = threading.Thread(target=self._write_loop, name="feature-capture", daemon=True)
        self._writer.start()

    # -- the model thread --------------------------------------------------------------------------------
    def attach_prompt_cache(self, cache, entry: str) -> None:
        """Keep each captured request's features in the engine's prompt cache (a PrefixCache) as `entry`
        (features_entry of the target's feature layers), and take a restored prefix's from there."""
        self._prompt_cache, self._entry = cache, entry

    def observe(self, seq, start: int, features: torch.Tensor) -> None:
        """features [n, H]: the target's last hidden state at positions start .. start + n - 1 of seq's text."""
        parts = self._parts.get(seq)
        if parts is None:  # the request's first features: those of a prefix restored before them, if any
            parts = self._parts[seq] = self._restored(seq, start)
        parts.append((start, features.detach().to("cpu", copy=True)))

    def finish(self, seq, request_id: str, finish_reason: str | None) -> None:
        """The request has ended: if with its answer (ANSWERED), its contiguous positions from the first, queued for
        the writer (or counted); an answer cut short (an error, a cancel, the guard) is not kept."""
        parts = self._parts.pop(seq, None)
        if not parts or finish_reason not in ANSWERED:
            return
        features = _contiguous(parts)
        if features is None:
            self.incomplete += 1
            return
        length = min(len(features), len(seq.context) - 1)  # (each position's next token is the label)
        features = features[:length].clone()  # [length, H]: the file's, and the prompt cache's entry
        if self._prompt_cache is not None:
            self._prompt_cache.put(self._entry, seq.context[:length], [features], [])
        record = {"ids": torch.tensor(seq.context[:length], dtype=torch.int32),
                  "features": features,
                  "next": torch.tensor(seq.context[1:length + 1], dtype=torch.int32),
                  "answer_start": torch.tensor([len(seq.prompt_ids)], dtype=torch.int32)}
        meta = {"request_id": request_id, "ended": f"{time.time():.3f}",
                "greedy": str(bool(seq.cfg.sampling.greedy)).lower()}
        try:
            self._queue.put_nowait((record, meta))
        except queue.Full:
            self.dropped += 1

    def _restored(self, seq, first: int) -> list[tuple[int, torch.Tensor]]:
        """The features of the prefix before `first` that the target did not compute (restored from the prompt
        cache), as the cache keeps them from the request that computed it (taken now: the cache may let them go
        before this request ends); none where it does not hold them (a head's entry may be on the target's
        device)."""
        if first == 0 or self._prompt_cache is None:
            return []
        entry, length = self._prompt_cache.longest(self._entry, seq.context[:first], count=False)
        return [(0, entry.keys[0][:first].to("cpu"))] if length >= first else []

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (up to timeout_s), then stop the writer."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._writer.join(timeout_s)

    # -- the writer thread -------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            record, meta = item
            ended_ms = int(float(meta["ended"]) * 1000)
            path = self.folder / f"{PREFIX}{ended_ms:013d}-{meta['request_id'][:32]}.safetensors"
            try:
                write_whole(path, lambda p: _save_private(record, meta, p))
                self.written += 1
                self._keep_to_budget()
            except OSError:  # a full disk costs the capture, never the server
                self.dropped += 1

    def _keep_to_budget(self) -> None:
        """The earliest files go until the folder is within max_bytes (the newest one always stays)."""
        files = sorted(self.folder.glob(f"{PREFIX}*.safetensors"))
        sizes = [path.stat().st_size for path in files]
        total = sum(sizes)
        for path, size in zip(files[:-1], sizes):
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


def captured_files(folder: str | Path) -> list[Path]:
    """A capture folder's files, earliest request first."""
    return sorted(Path(folder).glob(f"{PREFIX}*.safetensors"))


def _save_private(record: dict[str, torch.Tensor], meta: dict[str, str], path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # (users' text: owner alone, from the start)
    os.close(fd)
    save_file({f"{name}.0": tensor for name, tensor in record.items()}, str(path), metadata=meta)


def _contiguous(parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor | None:
    """The parts' rows from position 0 on, as far as they run without a gap ([n, H]); None where 0 is missing."""
    rows, end = [], 0
    for start, features in sorted(parts, key=lambda part: part[0]):
        if start > end:
            break
        rows.append(features[end - start:])
        end = max(end, start + len(features))
    return torch.cat(rows) if rows else None
