"""The server's Prometheus metrics, every name prefixed draftwise_, in a registry of its own (so two servers in
one process, as in the tests, never share counters)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds from a fraction of a millisecond (tiny models) to minutes (long requests on a CPU).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class ServeMetrics:
    def __init__(self, arms: tuple[str, ...] = ("",)):
        """Every per-request metric has an `arm` label: the A/B arm that served the request (experiment.py; ""
        without an experiment). The step-level ones (passes, draft/verify/overhead seconds, batch size, prefill)
        have none: one batched step serves requests of every arm at once. arms: the labels the arm-only metrics
        show (at 0) from the start."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.proposed = Counter("draftwise_proposed_tokens", "Draft tokens proposed", ["method", "arm"], registry=r)
        self.accepted = Counter("draftwise_accepted_tokens", "Draft tokens the target kept", ["method", "arm"],
                                registry=r)
        self.proposed_at = Counter("draftwise_proposed_tokens_by_position",
                                   "Draft tokens proposed at each draft position (0 = first)", ["position", "arm"],
                                   registry=r)
        self.accepted_at = Counter("draftwise_accepted_tokens_by_position",
                                   "Draft tokens kept at each draft position (0 = first)", ["position", "arm"],
                                   registry=r)
        self.passes = Counter("draftwise_verification_passes", "Batched target passes (one per step)", registry=r)
        self.emitted = Counter("draftwise_emitted_tokens", "Tokens sent to clients", ["arm"], registry=r)
        self.draft_s = Histogram("draftwise_draft_seconds", "Drafting time per step", buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.verify_s = Histogram("draftwise_verify_seconds", "Verification time per step (one batched pass)",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.overhead_s = Histogram("draftwise_scheduling_overhead_seconds",
                                    "Step time outside drafting and verifying", buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_s = Histogram("draftwise_prefill_chunk_seconds", "Time per prefill chunk",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("draftwise_batch_size", "Sequences per step", buckets=BATCH_BUCKETS, registry=r)
        self.ttft = Histogram("draftwise_time_to_first_token_seconds", "Request arrival to its first token",
                              ["arm"], buckets=LATENCY_BUCKETS, registry=r)
        self.tbt = Histogram("draftwise_time_between_tokens_seconds", "Gap between a request's consecutive tokens",
                             ["arm"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("draftwise_request_seconds", "Request arrival to its last byte",
                             ["arm"], buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("draftwise_requests", "Finished requests by finish reason", ["finish_reason", "arm"],
                                registry=r)
        self.rejected = Counter("draftwise_rejected_requests", "Requests refused, by reason", ["reason"], registry=r)
        self.fallbacks = Counter("draftwise_proposer_fallbacks",
                                 "Requests put on the target alone because their proposer failed, by reason "
                                 "(error, timeout)", ["reason", "arm"], registry=r)
        self.guard_blocks = Counter("draftwise_guard_blocks", "Responses the guard ended (content_filter)",
                                    ["arm"], registry=r)
        self.log_dropped = Gauge("draftwise_proposal_log_dropped_rows",
                                 "Proposal log rows dropped because the writer fell behind", registry=r)
        self.prompt_lookups = Counter("draftwise_prompt_cache_lookups", "Prompts looked up in the prompt cache",
                                      registry=r)
        self.prompt_hits = Counter("draftwise_prompt_cache_hits", "Prompts that reused a cached prefix", registry=r)
        self.prompt_saved = Counter("draftwise_prompt_cache_saved_tokens",
                                    "Prompt tokens restored from the prompt cache instead of prefilled", registry=r)
        self.prompt_bytes = Gauge("draftwise_prompt_cache_bytes", "Bytes the prompt cache holds", registry=r)
        self.running = Gauge("draftwise_running_requests", "Requests in the running batch", registry=r)
        self.waiting = Gauge("draftwise_waiting_requests", "Requests waiting to join the batch", registry=r)
        self.trials = Counter("draftwise_draft_trials", "Draft versions put on trial, by outcome (promoted, rolled "
                              "back, failed)", ["outcome"], registry=r)
        self.trial_speed = Gauge("draftwise_draft_trial_tokens_per_second",
                                 "Mean decode tokens/s a request of the trial under way's arms", ["arm"], registry=r)
        self.trial_acceptance = Gauge("draftwise_draft_trial_acceptance", "Draft tokens kept in the trial's arms",
                                      ["arm"], registry=r)
        for arm in arms:  # shown at 0 before the first request, as unlabelled metrics are
            for metric in (self.emitted, self.ttft, self.tbt, self.e2e, self.guard_blocks):
                metric.labels(arm)

    # -- called by the scheduler (model thread) ------------------------------------------------------
    def observe_step(self, batch_size: int, draft_s: float, verify_s: float, overhead_s: float) -> None:
        self.passes.inc()
        self.batch.observe(batch_size)
        self.draft_s.observe(draft_s)
        self.verify_s.observe(verify_s)
        self.overhead_s.observe(overhead_s)

    def observe_round(self, method: str, num_proposed: int, num_accepted: int, arm: str = "") -> None:
        if num_proposed:
            self.proposed.labels(method, arm).inc(num_proposed)
            self.accepted.labels(method, arm).inc(num_accepted)
        for i in range(num_proposed):
            self.proposed_at.labels(str(i), arm).inc()
            if i < num_accepted:
                self.accepted_at.labels(str(i), arm).inc()

    def observe_trial(self, trial) -> None:
        """A rollout's trial (rollout.Trial) after each request it judged, and at its decision."""
        for arm, samples in trial.arms.items():
            self.trial_speed.labels(arm).set(samples.mean)
            self.trial_acceptance.labels(arm).set(samples.accepted / samples.proposed if samples.proposed else 0.0)
        if trial.decided is not None:
            self.trials.labels(trial.state).inc()

    def observe_emitted(self, n: int, arm: str = "") -> None:
        self.emitted.labels(arm).inc(n)

    def observe_fallback(self, reason: str, arm: str = "") -> None:
        self.fallbacks.labels(reason, arm).inc()

    def observe_guard_block(self, arm: str = "") -> None:
        self.guard_blocks.labels(arm).inc()

    def observe_prompt_cache(self, reused_tokens: int) -> None:
        self.prompt_lookups.inc()
        if reused_tokens:
            self.prompt_hits.inc()
            self.prompt_saved.inc(reused_tokens)

    def observe_prefill(self, seconds: float) -> None:
        self.prefill_s.observe(seconds)

    def set_load(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    # -- called by the HTTP side ---------------------------------------------------------------------
    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
