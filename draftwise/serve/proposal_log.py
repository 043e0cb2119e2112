"""`--proposal-log PATH`: every proposed token of every round, in SQLite, written off the hot path.

The model thread only puts rows on a bounded queue (never blocks: when the queue is full, the rows are
dropped and counted, never the request); a writer thread inserts them in batches. The file is in WAL mode,
so `draftwise log stats` can read it while the server writes. It is bounded: past max_rows, the oldest rows
go (and the requests that no row refers to any more).

Tables:
- rounds: one row per proposed token: request id, arm, step (the request's round number), position in the
  draft, offset (the text's length before the round), proposed token, the target's token there (the draft
  token where it was kept, the target's own at the first rejected position, NULL after it), accepted (0/1),
  method, draft and verify seconds of the round's step, time;
- requests: the prompt and output ids of each finished request, and why its proposer was dropped if it was
  (the server's fallback), so that `draftwise log export` can give the
  (context, target token) pairs a later distillation trains the draft on; and its arm, counts and timing
  (tokens, target passes, proposed, accepted, decode seconds, seconds from submission to its first and last
  token), so that `draftwise log stats` can compare A/B arms (experiment.py). Requests served by the target
  alone are recorded only under an experiment, where an "off" arm is the baseline;
- meta: rows dropped because the disk fell behind (proposed-token rows, and request rows apart).

It holds what users wrote (as token ids, which decode to the text): it is made readable by its owner alone (0600;
SQLite gives its WAL and shared-memory files the same mode), deleted rows are overwritten (secure_delete), rows
older than max_age_s go as new ones come, and `draftwise log purge` removes them on demand.
"""
from __future__ import annotations

import json
import os
import queue
import sqlite3
import threading
import time
from pathlib import Path

from draftwise.errors import DraftwiseError
from draftwise.metrics import Stats

SCHEMA = """
CREATE TABLE IF NOT EXISTS rounds (
    id INTEGER PRIMARY KEY, ts REAL NOT NULL, request_id TEXT NOT NULL, arm TEXT NOT NULL, step INTEGER NOT NULL,
    position INTEGER NOT NULL, offset INTEGER NOT NULL, proposed INTEGER NOT NULL, target INTEGER,
    accepted INTEGER NOT NULL, method TEXT NOT NULL, draft_s REAL NOT NULL, verify_s REAL NOT NULL);
CREATE INDEX IF NOT EXISTS rounds_request ON rounds (request_id);
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY, ts REAL NOT NULL, arm TEXT NOT NULL, method TEXT NOT NULL,
    prompt_ids TEXT NOT NULL, output_ids TEXT NOT NULL, finish TEXT, fallback TEXT);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS rounds_ts ON rounds (ts);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
"""
# Added to the requests table by connect(), in new logs and in logs written before them (NULL in old rows).
REQUEST_TIMING = {"new_tokens": "INTEGER", "passes": "INTEGER", "proposed": "INTEGER", "accepted": "INTEGER",
                  "decode_s": "REAL", "ttft_s": "REAL", "last_token_s": "REAL"}
ROUND_COLUMNS = ("ts", "request_id", "arm", "step", "position", "offset", "proposed", "target", "accepted",
                 "method", "draft_s", "verify_s")
REQUEST_COLUMNS = ("request_id", "ts", "arm", "method", "prompt_ids", "output_ids", "finish", "fallback",
                   *REQUEST_TIMING)
DEFAULT_MAX_ROWS = 5_000_000
DEFAULT_QUEUE = 10_000  # batches of rows (one per round), not rows
RETENTION_EVERY_S = 60.0  # how often rows past --proposal-log-days go, also while no request comes


def round_rows(request_id: str, arm: str, step: int, offset: int, method: str, proposed: tuple[int, ...],
               num_accepted: int, next_token: int, draft_s: float, verify_s: float) -> list[tuple]:
    """The rows of one round: the target's token is known up to the first rejection (its own pick there)."""
    now = time.time()
    rows = []
    for position, token in enumerate(proposed):
        target = token if position < num_accepted else next_token if position == num_accepted else None
        rows.append((now, request_id, arm, step, position, offset, token, target, int(position < num_accepted),
                     method, draft_s, verify_s))
    return rows


class ProposalLog:
    def __init__(self, path: str | Path, max_rows: int = DEFAULT_MAX_ROWS, queue_size: int = DEFAULT_QUEUE,
                 max_age_s: float | None = None):
        """max_age_s: rows older than this go (None: by max_rows alone)."""
        if max_rows < 1 or queue_size < 1:
            raise DraftwiseError("--proposal-log-rows and the queue size must be >= 1")
        if max_age_s is not None and not max_age_s > 0:
            raise DraftwiseError(f"--proposal-log-days must be > 0, got {max_age_s / 86400:g}")
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))  # the owner's alone, from its first byte
            for path in (self.path, *(self.path.with_name(self.path.name + end) for end in ("-wal", "-shm"))):
                if path.exists():
                    os.chmod(path, 0o600)  # (an existing log's too)
            connect(self.path, create=True).close()  # a bad path fails at start, not in the writer
        except (OSError, sqlite3.Error) as err:
            raise DraftwiseError(f"cannot write the proposal log at {self.path}: {err}") from err
        self.max_rows, self.max_age_s = max_rows, max_age_s
        self._next_retention = 0.0  # (monotonic) when the writer next drops the rows past max_age_s
        self.dropped = 0  # proposed-token rows lost: no room in the queue, or a write that failed
        self.requests_dropped = 0  # request rows lost the same ways: their arm's comparison in `log stats` lacks them
        self._counting = threading.Lock()  # (the model thread and the writer both count)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._write_loop, name="draftwise-proposal-log", daemon=True)
        self._thread.start()

    # -- the model thread: never blocks ---------------------------------------------------------------
    def record_round(self, rows: list[tuple]) -> None:
        self._put(("rounds", rows), len(rows))

    def record_request(self, request_id: str, arm: str, method: str, prompt_ids: list[int], output_ids: list[int],
                       finish: str | None, fallback: str | None = None, stats: Stats | None = None,
                       ttft_s: float | None = None, last_token_s: float | None = None) -> None:
        """ttft_s, last_token_s: seconds from submission to the request's first and last token sent."""
        if finish == "content_filter":  # the guard blocked this text: it is neither kept nor trained on
            output_ids = []
        counts = ((stats.new_tokens, stats.target_forwards, stats.proposed, stats.accepted, stats.decode_s)
                  if stats is not None else (None,) * 5)
        row = (request_id, time.time(), arm, method, json.dumps(prompt_ids), json.dumps(output_ids), finish, fallback,
               *counts, ttft_s, last_token_s)
        self._put(("requests", [row]), 0, 1)

    def _put(self, item, rows: int, requests: int = 0) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._lost(rows, requests)

    def _lost(self, rows: int, requests: int) -> None:
        with self._counting:
            self.dropped += rows
            self.requests_dropped += requests

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the writer."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:  # the writer is gone or hopelessly behind: the daemon thread dies with the process
            return
        self._thread.join(timeout)

    # -- the writer thread ----------------------------------------------------------------------------
    def _write_loop(self) -> None:
        try:
            db = connect(self.path)
        except (OSError, sqlite3.Error, DraftwiseError):  # (the file went away since start): rows are lost, counted
            db = None
        try:
            while True:
                try:
                    batch = [self._queue.get(timeout=None if self.max_age_s is None else RETENTION_EVERY_S)]
                except queue.Empty:  # nothing to write: only the rows that aged out go
                    batch = []
                while len(batch) < 1000:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                stop = None in batch
                items = [item for item in batch if item is not None]
                try:
                    if db is None:
                        raise sqlite3.OperationalError(f"the proposal log at {self.path} could not be opened")
                    self._write(db, items)
                except sqlite3.Error:  # a full disk, a locked file: these rows are lost and counted, not the writer
                    self._lost(sum(len(rows) for kind, rows in items if kind == "rounds"),
                               sum(len(rows) for kind, rows in items if kind == "requests"))
                if stop:
                    return
        finally:
            if db is not None:
                db.close()

    def _write(self, db: sqlite3.Connection, items: list) -> None:
        rounds = [row for kind, rows in items if kind == "rounds" for row in rows]
        requests = [row for kind, rows in items if kind == "requests" for row in rows]
        with db:
            db.executemany(f"INSERT INTO rounds ({', '.join(ROUND_COLUMNS)}) VALUES "
                           f"({', '.join('?' * len(ROUND_COLUMNS))})", rounds)
            db.executemany(f"INSERT OR REPLACE INTO requests ({', '.join(REQUEST_COLUMNS)}) VALUES "
                           f"({', '.join('?' * len(REQUEST_COLUMNS))})", requests)
            blocked = [(row[0],) for row in requests if row[REQUEST_COLUMNS.index("finish")] == "content_filter"]
            db.executemany("DELETE FROM rounds WHERE request_id = ?", blocked)  # their rows came before: FIFO
            db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                           [("dropped", self.dropped), ("requests_dropped", self.requests_dropped)])
            self._rotate(db)

    def _rotate(self, db: sqlite3.Connection) -> None:
        newest = db.execute("SELECT MAX(id) FROM rounds").fetchone()[0] or 0
        oldest = db.execute("SELECT MIN(id) FROM rounds").fetchone()[0] or 0
        if newest - oldest + 1 > self.max_rows:
            db.execute("DELETE FROM rounds WHERE id <= ?", (newest - self.max_rows,))
            # A request that proposed goes with its last row; one that never did (an "off" arm) goes with the rows
            # of its time, so that the arms kept are compared over the same span. (NULL: a row from before.)
            db.execute("DELETE FROM requests WHERE request_id NOT IN (SELECT DISTINCT request_id FROM rounds) "
                       "AND (COALESCE(proposed, 1) > 0 OR ts < (SELECT MIN(ts) FROM rounds))")
        last = db.execute("SELECT MAX(rowid) FROM requests").fetchone()[0] or 0
        db.execute("DELETE FROM requests WHERE rowid <= ?", (last - self.max_rows,))  # e.g. every arm "off"
        if self.max_age_s is not None and time.monotonic() >= self._next_retention:
            delete_before(db, time.time() - self.max_age_s)
            self._next_retention = time.monotonic() + RETENTION_EVERY_S


def delete_before(db: sqlite3.Connection, ts: float) -> tuple[int, int]:
    """Delete every row of a request that finished before ts, and every round before ts -> (rounds, requests)."""
    old = "SELECT request_id FROM requests WHERE ts < ?"
    rounds = db.execute(f"DELETE FROM rounds WHERE ts < ? OR request_id IN ({old})", (ts, ts)).rowcount
    requests = db.execute("DELETE FROM requests WHERE ts < ?", (ts,)).rowcount
    return rounds, requests


def connect(path: Path, create: bool = False) -> sqlite3.Connection:
    """A connection in WAL mode (readers never wait on the writer); create=True makes the tables."""
    if not create and not Path(path).is_file():
        raise DraftwiseError(f"no proposal log at {path}: give the PATH that `draftwise serve --proposal-log` wrote")
    db = sqlite3.connect(path, timeout=30)
    try:
        if not create:
            _require_log(db, path)  # before the WAL switch: a file that is not a log is left as it was
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA secure_delete=ON")  # a deleted row's bytes are overwritten, not left in a free page
        if create:
            db.executescript(SCHEMA)
        _add_missing_columns(db)
    except BaseException:
        db.close()
        raise
    return db


def _require_log(db: sqlite3.Connection, path: Path) -> None:
    try:
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError:  # not an SQLite file at all
        tables = set()
    if not {"requests", "rounds"} <= tables:
        raise DraftwiseError(f"{path} is not a proposal log: give the PATH that `draftwise serve --proposal-log` "
                             f"wrote")


def _add_missing_columns(db: sqlite3.Connection) -> None:
    have = {row[1] for row in db.execute("PRAGMA table_info(requests)")}  # (connect made or required the table)
    with db:
        for name, kind in REQUEST_TIMING.items():
            if name not in have:
                db.execute(f"ALTER TABLE requests ADD COLUMN {name} {kind}")
