"""A new draft version put in front safely, without a restart: loaded beside the current draft, served to a share of
the live traffic, and promoted or rolled back by what that traffic shows.

Why it is safe to try a draft on users at all: the output is the target's whatever the draft (greedy: its tokens;
sampled: its distribution), so a bad draft can only cost speed, and a trial bounds how much and for how long.

The judgement: each finished request of either arm gives its decode tokens per second; the arms are compared by a
mixture sequential probability ratio test (mSPRT, Johari et al. 2017) on the difference of their means, which stays
valid however often it is looked at: it may stop at the first request past the threshold and still be wrong at most
a share alpha of the time. The candidate is promoted when it is faster with that confidence, rolled back when it is
slower, and rolled back too when MAX_REQUESTS of it show no difference (it brings nothing for its risk). Its
acceptance is shown beside, not tested: speed is what users get. Every decision is kept with its reason.

Which thread does what: a draft's weights are read from disk on a thread of its own (load touches no engine method);
the draft then joins the engine (add_draft builds its backend on the kernels), and a decision promotes or removes it,
on the model loop, the only caller of the engine's methods: `on_loop` hands them to it (Scheduler.call, wired by
app.py; without a server, they run where they are called). Reads of the draft in front and of the loaded names are
of values the loop replaces whole.
"""
from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from draftwise.errors import DraftwiseError

CURRENT, CANDIDATE = "current", "candidate"
ALPHA = 0.05  # the test's error rate
MIN_REQUESTS = 8  # of each arm before any decision: a variance of fewer says little
MAX_REQUESTS = 400  # of the candidate without a decision: rolled back as no better
EFFECT = 0.2  # the mixture's scale: effects of about this share of the current arm's speed are the ones looked for
SHARE = 0.5  # of the requests that leave their speculation to the server, served by the candidate on trial

log = logging.getLogger(__name__)


class TrialUnderWay(DraftwiseError):
    """One trial at a time: a second waits for the first's decision."""


@dataclass
class Samples:
    """Welford's running mean and variance of one arm's per-request tokens/s, and its acceptance."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    proposed: int = 0
    accepted: int = 0

    def add(self, value: float, proposed: int, accepted: int) -> None:
        self.n += 1
        delta = value - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (value - self.mean)
        self.proposed += proposed
        self.accepted += accepted

    @property
    def variance(self) -> float:
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0

    def summary(self) -> dict:
        return {"requests": self.n, "tokens_per_s": round(self.mean, 3),
                "acceptance": round(self.accepted / self.proposed, 4) if self.proposed else None}


def likelihood_ratio(current: Samples, candidate: Samples, scale: float) -> float:
    """The mSPRT's ratio for "the arms' means differ" against "they are equal", with a normal mixture of this scale
    (tokens/s) over the difference; 1/alpha or more rejects equality."""
    v = current.variance / current.n + candidate.variance / candidate.n
    tau2 = scale ** 2
    if v <= 0 or tau2 <= 0:
        return 1.0
    d = candidate.mean - current.mean
    return math.sqrt(v / (v + tau2)) * math.exp(min(700.0, tau2 * d * d / (2 * v * (v + tau2))))


@dataclass
class Trial:
    candidate: str
    current: str | None  # the draft the current arm drafts with (None: the engine's own)
    state: str = "loading"  # loading, testing, promoted, rolled back, failed
    reason: str = ""
    started: float = field(default_factory=time.time)
    decided: float | None = None
    arms: dict[str, Samples] = field(default_factory=lambda: {CURRENT: Samples(), CANDIDATE: Samples()})
    ratio: float = 1.0
    # The mixture's scale, set once at the first judgement (EFFECT x the current arm's mean then): a scale that moved
    # with the data at every look would void the test's guarantee.
    scale: float | None = None

    def summary(self) -> dict:
        return {"candidate": self.candidate, "current": self.current or "the server's own draft", "state": self.state,
                "reason": self.reason, "started": self.started, "decided": self.decided,
                "likelihood_ratio": round(self.ratio, 3), "arms": {arm: s.summary() for arm, s in self.arms.items()}}


class Rollouts:
    """The server's draft versions: the one in front (None: the draft it started with) and the trials, one at a time.
    assign() is the A/B arm of a request that leaves its speculation to the server (as an Experiment's); observe()
    takes each finished request; a decision changes the draft in front."""

    def __init__(self, engine, load, check=lambda name: None, rng: random.Random | None = None, share: float = SHARE,
                 alpha: float = ALPHA, min_requests: int = MIN_REQUESTS, max_requests: int = MAX_REQUESTS):
        """load(name) -> the draft model of a version (loading.load_draft_version), on a thread of its own; check(name)
        refuses at once a name load could never load; observer(trial) hears of each change (metrics)."""
        self.engine, self.load, self.check, self.rng = engine, load, check, rng or random.Random()
        self.observer = lambda trial: None
        self.on_loop: Callable[[Callable[[], object]], Future] = run_here  # how work reaches the engine's thread
        self.share, self.alpha, self.min_requests, self.max_requests = share, alpha, min_requests, max_requests
        self.trials: list[Trial] = []
        self._lock = threading.Lock()

    @property
    def in_front(self) -> str | None:
        """The version the draft-model methods draft with (None: the draft the server started with)."""
        return self.engine.draft_in_front

    @property
    def trial(self) -> Trial | None:
        """The trial under way (loading or testing), if any."""
        last = self.trials[-1] if self.trials else None
        return last if last is not None and last.state in ("loading", "testing") else None

    def start(self, candidate: str) -> Trial:
        """Load candidate beside the draft in front and put it on trial; refused while another is under way."""
        self.check(candidate)
        with self._lock:
            if self.trial is not None:
                raise TrialUnderWay(f"draft {self.trial.candidate!r} is on trial; wait for its decision")
            if candidate in self.engine.drafts_available:  # (the one in front among them)
                raise DraftwiseError(f"draft {candidate!r} is already loaded here")
            trial = Trial(candidate, self.in_front)
            self.trials.append(trial)
        threading.Thread(target=self._load, args=(trial,), name="draftwise-draft-load", daemon=True).start()
        return trial

    def _load(self, trial: Trial) -> None:
        """On the load thread: the weights here, then their joining the engine on the model loop."""
        try:
            model = self.load(trial.candidate)
        except Exception as err:  # a missing or damaged version: nothing changes in front
            reason = f"could not load it: {err}"
            done = self.on_loop(lambda: self._decide(trial, "failed", reason))
        else:
            done = self.on_loop(lambda: self._join(trial, model))
        try:
            done.result()
        except Exception:  # (the server stopped first, or a bug of ours: the trial stays as it was)
            log.exception("draft %s: its loading could not finish", trial.candidate)

    def _join(self, trial: Trial, model) -> None:
        """On the model loop: the loaded draft beside the one in front, on trial."""
        try:
            self.engine.add_draft(trial.candidate, model)
        except Exception as err:  # one the engine refuses (another vocabulary, a shorter context)
            self._decide(trial, "failed", f"could not load it: {err}")
            return
        trial.state = "testing"

    def assign(self, body: dict) -> tuple[str, object]:
        """(arm, the speculation a request that leaves it to the server is served with)."""
        if body.get("speculation") is not None:
            return "", body["speculation"]
        trial = self.trial
        # (a seeded request may go to either arm: its text is its seed's draws from the target, whatever the draft)
        if trial is not None and trial.state == "testing" and self.rng.random() < self.share:
            return CANDIDATE, {"draft": trial.candidate}
        return (CURRENT if trial is not None and trial.state == "testing" else ""), None  # (the draft in front)

    def observe(self, arm: str, stats, finish: str | None) -> None:
        """A finished request of an arm: its decode tokens/s and acceptance; then the test."""
        trial = self.trial
        if trial is None or trial.state != "testing" or arm not in (CURRENT, CANDIDATE) or stats is None:
            return
        if finish in ("error", "cancelled") or stats.decode_s <= 0 or stats.new_tokens < 2:
            return  # cut short or too short to time
        with self._lock:
            if trial.state != "testing":
                return
            trial.arms[arm].add(stats.new_tokens / stats.decode_s, stats.proposed, stats.accepted)
            self._judge(trial)
        self.observer(trial)

    def _judge(self, trial: Trial) -> None:
        current, candidate = trial.arms[CURRENT], trial.arms[CANDIDATE]
        if min(current.n, candidate.n) < self.min_requests:
            return
        if trial.scale is None:
            trial.scale = EFFECT * current.mean
        trial.ratio = likelihood_ratio(current, candidate, trial.scale)
        pace = f"{candidate.mean:.2f} against {current.mean:.2f} tokens/s over {candidate.n} and {current.n} requests"
        if trial.ratio >= 1 / self.alpha:
            if candidate.mean > current.mean:
                self._decide(trial, "promoted", f"faster: {pace} (likelihood ratio {trial.ratio:.0f})")
            else:
                self._decide(trial, "rolled back", f"slower: {pace} (likelihood ratio {trial.ratio:.0f})")
        elif candidate.n >= self.max_requests:
            self._decide(trial, "rolled back", f"no difference shown: {pace}")

    def _decide(self, trial: Trial, state: str, reason: str) -> None:
        """On the model loop (observe() is called there, as each request ends; a load's failure is sent there)."""
        trial.state, trial.reason, trial.decided = state, reason, time.time()
        log.info("draft %s %s: %s", trial.candidate, state, reason)
        if state == "promoted":
            previous = self.in_front
            self.engine.promote_draft(trial.candidate)
            if previous is not None:
                self.engine.remove_draft(previous)  # (its open sequences finish on it)
        elif trial.candidate in self.engine.drafts_available:
            self.engine.remove_draft(trial.candidate)
        if state == "failed":
            self.observer(trial)  # (the others are heard with the request that decided them)

    def summary(self) -> dict:
        return {"in_front": self.in_front or "the server's own draft", "trials": [t.summary() for t in self.trials]}


def run_here(fn: Callable[[], object]) -> Future:
    """fn run at once, on the calling thread, as a done future: where no model loop runs (a Rollouts alone)."""
    future: Future = Future()
    try:
        future.set_result(fn())
    except Exception as err:
        future.set_exception(err)
    return future
