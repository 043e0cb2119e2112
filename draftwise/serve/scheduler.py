"""The model loop of the server: one thread owns the engine and steps every running sequence together.

Continuous batching: between steps, waiting requests join (up to max_batch running) and finished or cancelled
ones leave, giving their cache slots back. Each loop iteration runs at most one prefill chunk of a newcomer and
then one step of every sequence that is decoding, so a long prompt delays the others by a chunk, not by its
whole prefill. The HTTP side never touches the engine: it submits, cancels, and receives events through a
sink called from this thread. This thread is the only caller of the engine's and its backends' methods: what another
thread needs of them (intake's checks of a request, a rollout's draft joining the engine) it hands to this loop as a
job (call()), run between two steps, and waits on the job's future for the result or the error.

Around the step, the production loop: a proposer that fails (or drafts past the timeout) leaves its sequence
on the target alone (Engine's fallback); a guard sees each request's text before it is sent (guard.py); a
proposal log records every round off the hot path (proposal_log.py).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from draftwise.backends.prefix_cache import features_entry
from draftwise.config import GenerationConfig
from draftwise.engine import Engine
from draftwise.errors import DraftwiseError
from draftwise.sequence import Sequence
from draftwise.serve.guard import Guard, GuardedText
from draftwise.serve.feature_capture import FeatureCapture
from draftwise.serve.proposal_log import ProposalLog, round_rows
from draftwise.types import Event

log = logging.getLogger(__name__)
# How long the loop holds the batch's door open, at most, for the submits of requests whose checks it has just run
# (call(before_submit=True)): the HTTP side submits as soon as it hears, and a request that missed the door would join
# a whole step later than one submitted unchecked would have.
ADMIT_HOLD_S = 0.01
SHUT = "the server is shutting down and takes no new requests"


class QueueFull(DraftwiseError):
    """More requests wait than --max-waiting allows; the client should retry after retry_after seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(DraftwiseError):
    """The server is draining: running requests finish, new ones are refused."""


@dataclass(eq=False)
class Ticket:
    prompt_ids: list[int]
    cfg: GenerationConfig
    sink: Callable[[Event], None]
    request_id: str = ""
    arm: str = ""  # the A/B arm it was served by ("" without an experiment)
    submitted_at: float = field(default_factory=time.perf_counter)
    seq: Sequence | None = None
    rounds: int = 0  # verified rounds that proposed something (the proposal log's step)
    fell_back: bool = False  # its proposer failed and it goes on with the target alone
    guarded: GuardedText | None = None  # its text on the way out, when the server has a guard
    first_token_at: float | None = None  # when its first and latest tokens were handed to the HTTP side
    last_token_at: float | None = None
    cancelled: bool = False
    done: bool = False

    def token_sent(self) -> None:
        self.last_token_at = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = self.last_token_at

    def since_submitted(self, at: float | None) -> float | None:
        return None if at is None else at - self.submitted_at


class Scheduler:
    def __init__(self, engine: Engine, *, max_batch: int = 8, max_waiting: int = 64, prefill_chunk: int = 128,
                 metrics=None, proposal_log: ProposalLog | None = None, draft_timeout_s: float | None = None,
                 guard: Guard | None = None, feature_capture: FeatureCapture | None = None):
        """A failing proposer puts its sequence on the target alone (still exact), as does one whose step drafted
        for longer than draft_timeout_s; counted in metrics and the proposal log. feature_capture: where each
        finished request's target features go (serve/feature_capture.py)."""
        if max_batch < 1 or max_waiting < 0 or prefill_chunk < 1:
            raise DraftwiseError("max_batch and prefill_chunk must be >= 1 and max_waiting >= 0")
        if draft_timeout_s is not None and draft_timeout_s <= 0:
            raise DraftwiseError(f"the draft timeout must be > 0, got {draft_timeout_s}")
        engine.fall_back_on_proposer_error, engine.draft_timeout_s = True, draft_timeout_s
        self.engine = engine
        self.max_batch, self.max_waiting, self.prefill_chunk = max_batch, max_waiting, prefill_chunk
        self.metrics = metrics
        self.proposal_log = proposal_log
        self.guard = guard
        # Called on the model thread with (arm, stats, finish reason) as each request ends: a rollout's judgement.
        self.request_observer: Callable[[str, object, str | None], None] | None = None
        self._tickets: dict[Sequence, Ticket] = {}  # running sequences' tickets, for the proposal log
        if proposal_log is not None:
            engine.round_observer = self._log_round
        self.feature_capture = feature_capture
        if feature_capture is not None:
            engine.feature_sink = feature_capture.observe
            if engine.caches.prompt is not None:  # (a restored prompt's features come from there)
                feature_capture.attach_prompt_cache(engine.caches.prompt, features_entry(engine.target.feature_layers))
        self.fault_injector: Callable[[Sequence], None] | None = None  # tests: raise inside one sequence's round
        self._waiting: deque[Ticket] = deque()
        self._running: list[Ticket] = []
        self._jobs: deque[tuple[Callable[[], object], Future, bool]] = deque()  # call()'s, for the model loop
        self._due = 0  # submits the loop holds admission for (_hold_door)
        self._cond = threading.Condition()
        self._draining = False
        self._stopping = False
        self._stopped = False  # the loop has returned: a job would never run
        self._loop_thread: int | None = None  # the model loop's thread, once it runs
        self._thread: threading.Thread | None = None
        self._step_s = 0.5  # a running estimate of one step, for Retry-After

    # -- the HTTP side (any thread) -------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def draining(self) -> bool:
        return self._draining

    def start(self) -> None:
        """Run the model loop in a thread of its own (tests, and a server embedded in another program)."""
        self._thread = threading.Thread(target=self._loop, name="draftwise-scheduler", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Run the model loop on this thread until drain() stops it. `draftwise serve` runs it on the thread that
        loaded the models: a second thread running torch costs every forward time (see serve/command.py)."""
        self._loop()

    def call(self, fn: Callable[[], object], before_submit: bool = False) -> Future:
        """Run fn on the model loop, between two steps; the future gets what it returns or raises. How any other
        thread reaches the engine and its backends, whose one caller is the loop (on the loop's own thread, fn runs
        at once). A future cancelled before its turn is skipped; once the loop has stopped, it raises ShuttingDown.
        before_submit: fn checks a request that its caller submits as soon as the future says it passed (intake.py);
        the loop then holds admission a moment (ADMIT_HOLD_S at most) for that submit, so that the request joins the
        batch at the same step as it would had it been submitted unchecked."""
        future: Future = Future()
        if threading.get_ident() == self._loop_thread:
            _settle(future, fn)
            return future
        with self._cond:
            if self._stopped:
                future.set_exception(ShuttingDown(SHUT))
                return future
            self._jobs.append((fn, future, before_submit))
            self._cond.notify()
        return future

    def submit(self, prompt_ids: list[int], cfg: GenerationConfig, sink: Callable[[Event], None],
               request_id: str | None = None, request: dict | None = None, arm: str = "") -> Ticket:
        """Queue a request; never blocks. arm: the A/B arm it is served by, for its metrics and log rows.
        Raises QueueFull or ShuttingDown. The engine's checks (check_open) run on the model loop: a request they
        refuse ends with an error event, as one that fails to open; to have them raise instead, run them with
        call() and submit once they pass, as the server's intake does for every HTTP request."""
        ticket = Ticket(list(prompt_ids), cfg, sink, request_id=request_id or f"req-{uuid.uuid4().hex[:24]}",
                        arm=arm)
        if self.guard is not None:
            ticket.guarded = self.guard.stream(request or {})
        with self._cond:
            if self._due:  # (a request checked on the loop, which holds admission for it: here it is)
                self._due -= 1
                self._cond.notify()
            if self._draining:
                raise ShuttingDown(SHUT)
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (--max-waiting "
                                f"{self.max_waiting}); retry later", retry_after=self._retry_after())
            self._waiting.append(ticket)
            self._cond.notify()
        self._report_load()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The sequence leaves at the next step and its slots are freed; its final event says "cancelled"."""
        with self._cond:
            ticket.cancelled = True
            self._cond.notify()

    def drain(self, timeout: float) -> None:
        """Refuse new requests, let the admitted ones finish for up to timeout seconds, cancel the rest, stop."""
        with self._cond:
            self._draining = True
            self._cond.notify()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._cond:  # (admitting moves a ticket from waiting to running under this lock: never in neither)
                if not (self._waiting or self._running):
                    break
            time.sleep(0.02)
        with self._cond:
            for ticket in [*self._waiting, *self._running]:
                ticket.cancelled = True
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _retry_after(self) -> float:
        # The queue moves by about a batch per request's length; one step's time per waiting request is a floor.
        return max(1.0, round(self._step_s * (len(self._waiting) + 1), 1))

    # -- the model thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        self._loop_thread = threading.get_ident()
        try:
            self._iterate()
        finally:  # jobs that came too late to run: their callers hear that the server stopped
            with self._cond:
                self._stopped = True
                late, self._jobs = self._jobs, deque()
            for _, future, _ in late:
                if future.set_running_or_notify_cancel():
                    future.set_exception(ShuttingDown(SHUT))

    def _iterate(self) -> None:
        while True:
            with self._cond:
                while not (self._jobs or self._waiting or self._running or self._stopping):
                    self._cond.wait()
                jobs, self._jobs = self._jobs, deque()
                only_jobs = not (self._waiting or self._running or self._stopping)
            self._run_jobs(jobs)
            with self._cond:
                self._hold_door()
                if only_jobs and not (self._waiting or self._stopping):
                    continue  # (nothing to step: no step time to count)
                if self._stopping and not self._running and not self._waiting:
                    return
                self._admit()
            started = time.perf_counter()
            try:
                self._drop_cancelled()
                self._mark_alone()
                self._prefill_one()
                self._step()
            except Exception as err:  # a bug of ours: it ends the requests it reached, never the server
                log.exception("the model loop failed")
                for ticket in list(self._running):
                    self._fail(ticket, err)
            self._step_s = 0.9 * self._step_s + 0.1 * (time.perf_counter() - started)
            if self._stopping:
                self._drop_cancelled()
            self._report_load()

    def _run_jobs(self, jobs: deque) -> None:
        """Run call()'s jobs in the order they came."""
        for fn, future, before_submit in jobs:
            if not future.set_running_or_notify_cancel():  # its caller stopped waiting
                continue
            try:
                result = fn()
            except Exception as err:
                future.set_exception(err)
                continue
            if before_submit:
                with self._cond:  # (before its caller hears: the submit may come at once)
                    self._due += 1
            future.set_result(result)

    def _hold_door(self) -> None:
        """Under the lock: wait, ADMIT_HOLD_S at most, for the submits of requests whose checks just passed."""
        deadline = time.monotonic() + ADMIT_HOLD_S
        while self._due and not self._stopping and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)
        self._due = 0

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_batch:
            ticket = self._waiting.popleft()
            if ticket.cancelled:
                self._finish(ticket, Event(token_id=None, text="", finish_reason="cancelled"))
                continue
            try:
                ticket.seq = self.engine.open_sequence(ticket.prompt_ids, ticket.cfg)
            except Exception as err:  # checked at submit; anything left is this request's alone
                self._fail(ticket, err)
                continue
            self._running.append(ticket)
            self._tickets[ticket.seq] = ticket
            if self.metrics is not None and self.engine.prompt_cache is not None:
                self.metrics.observe_prompt_cache(ticket.seq.stats.prompt_cached)

    def _drop_cancelled(self) -> None:
        for ticket in [t for t in self._running if t.cancelled]:
            self._finish(ticket, Event(token_id=None, text="", finish_reason="cancelled",
                                       stats=ticket.seq.stats if ticket.seq else None))

    def _mark_alone(self) -> None:
        """A request decoding alone is filled before each probe and priced so, as generate's is
        (Sequence.fills_before_probes): else, once its draft lags past MAX_DRAFT_LAG, it sits out every later probe
        and never drafts again. With company, a probe is not worth every row's catch-up."""
        alone = len(self._running) == 1
        for ticket in self._running:
            ticket.seq.fills_before_probes = alone

    def _prefill_one(self) -> None:
        """One chunk: of a newcomer's prompt, else of a lagging draft's text once speculation pays again."""
        ticket = (next((t for t in self._running if not t.seq.prefill_done), None)
                  or next((t for t in self._running if self.engine.wants_catch_up(t.seq)), None))
        if ticket is None:
            return
        started = time.perf_counter()
        try:
            if ticket.seq.prefill_done:
                self.engine.catch_up_draft(ticket.seq, self.prefill_chunk)
            else:
                self.engine.prefill(ticket.seq, self.prefill_chunk)
        except Exception as err:
            self._fail(ticket, err)
            return
        if self.metrics is not None:
            self.metrics.observe_prefill(time.perf_counter() - started)

    def _step(self) -> None:
        ready = []
        for ticket in list(self._running):  # (a ticket failed here leaves _running)
            if not ticket.seq.prefill_done:
                continue
            try:
                if self.fault_injector is not None:
                    self.fault_injector(ticket.seq)
            except Exception as err:
                self._fail(ticket, err)
                continue
            ready.append(ticket)
        if not ready:
            return
        started = time.perf_counter()
        before = {t: (t.seq.stats.proposed, t.seq.stats.accepted) for t in ready}
        try:
            events = self.engine.step([t.seq for t in ready])
        except Exception as err:  # step isolates sequences itself; this is a bug, and ends the batch, not the server
            for ticket in ready:
                self._fail(ticket, err)
            return
        elapsed = time.perf_counter() - started
        for ticket in ready:
            if self.metrics is not None and ticket.seq.stats.fallback and not ticket.fell_back:
                self.metrics.observe_fallback("timeout" if ticket.seq.stats.fallback.startswith("TimeoutError")
                                              else "error", ticket.arm)
            ticket.fell_back = bool(ticket.seq.stats.fallback)
            self._deliver(ticket, events[ticket.seq], before[ticket])
        if self.metrics is not None:
            times = self.engine.last_step
            self.metrics.observe_step(len(ready), times.draft_s, times.verify_s,
                                      max(0.0, elapsed - times.draft_s - times.verify_s))

    def _deliver(self, ticket: Ticket, events: list[Event], before: tuple[int, int]) -> None:
        stats = ticket.seq.stats
        if self.metrics is not None and ticket.seq.finish != "error":
            self.metrics.observe_round(ticket.seq.method, stats.proposed - before[0], stats.accepted - before[1],
                                       ticket.arm)
            self.metrics.observe_emitted(sum(e.token_id is not None for e in events), ticket.arm)
        for event in events:
            if ticket.guarded is not None:
                try:
                    released = ticket.guarded.add(event.text, final=event.finish_reason is not None)
                except Exception as err:  # a broken guard fails closed: what it has not passed stays here
                    self._fail(ticket, RuntimeError(f"the guard raised {type(err).__name__}: {err}"))
                    return
                if released is None:  # nothing of the blocked text leaves: end here
                    if self.metrics is not None:
                        self.metrics.observe_guard_block(ticket.arm)
                    self._finish(ticket, Event(token_id=None, text="", finish_reason="content_filter",
                                               stats=ticket.seq.stats))
                    return
                event = replace(event, text=released)
            if event.finish_reason is not None:
                self._finish(ticket, event)
            else:
                if event.token_id is not None:
                    ticket.token_sent()
                self._send(ticket, event)

    def _fail(self, ticket: Ticket, err: BaseException) -> None:
        stats = ticket.seq.stats if ticket.seq else None
        self._finish(ticket, Event(token_id=None, text="", finish_reason="error", stats=stats,
                                   error=f"{type(err).__name__}: {err}"))

    def _finish(self, ticket: Ticket, event: Event) -> None:
        if ticket.done:
            return
        ticket.done = True
        try:
            if ticket.seq is not None:
                self._tickets.pop(ticket.seq, None)
                self.engine.close_sequence(ticket.seq)
                # The target alone proposes nothing to learn from; but under an experiment an "off" arm is the
                # baseline the other arms are compared with (`draftwise log stats`).
                if self.proposal_log is not None and (ticket.seq.method != "none" or ticket.arm):
                    self._log_request(ticket, event)
                if self.feature_capture is not None:
                    self.feature_capture.finish(ticket.seq, ticket.request_id, event.finish_reason)
                if self.request_observer is not None:
                    self.request_observer(ticket.arm, ticket.seq.stats, event.finish_reason)
        except Exception:  # the request is answered either way; a failed clean-up must not stop the loop
            log.exception("cleaning up request %s failed", ticket.request_id)
        finally:
            with self._cond:
                if ticket in self._running:
                    self._running.remove(ticket)
            self._send(ticket, event)

    def _log_request(self, ticket: Ticket, event: Event) -> None:
        seq = ticket.seq
        self.proposal_log.record_request(ticket.request_id, ticket.arm, seq.method, seq.prompt_ids,
                                         seq.context[len(seq.prompt_ids):], event.finish_reason, seq.stats.fallback,
                                         stats=seq.stats, ttft_s=ticket.since_submitted(ticket.first_token_at),
                                         last_token_s=ticket.since_submitted(ticket.last_token_at))

    def _send(self, ticket: Ticket, event: Event) -> None:
        try:
            ticket.sink(event)
        except Exception:  # a broken sink is its client's problem; the loop and the others go on
            ticket.cancelled = True

    def _log_round(self, seq: Sequence, draft, verdict, times) -> None:
        ticket = self._tickets.get(seq)
        if ticket is None:
            return
        ticket.rounds += 1
        self.proposal_log.record_round(round_rows(
            ticket.request_id, ticket.arm, ticket.rounds, len(seq.context), seq.method, draft.as_chain(verdict),
            verdict.num_accepted, verdict.next_token, times.draft_s, times.verify_s))

    def _report_load(self) -> None:
        if self.metrics is not None:
            self.metrics.set_load(len(self._running), len(self._waiting))
            if self.proposal_log is not None:
                self.metrics.log_dropped.set(self.proposal_log.dropped)
            if self.engine.prompt_cache is not None:
                self.metrics.prompt_bytes.set(self.engine.prompt_cache.nbytes)


def _settle(future: Future, fn: Callable[[], object]) -> None:
    """Run fn into future: its result, or the exception it raised."""
    try:
        future.set_result(fn())
    except Exception as err:
        future.set_exception(err)
