"""Issue 58: one JSON line per engine step (rows, draft and verify seconds, tokens emitted, the policy's inputs and
prices), per draft catch-up, and per scheduler call into the engine (open, prefill, close), patched on the classes so
that every engine and every drafter's policy is traced: for inprocess_load.py and traced_serve.py, read by
steps_summary.py."""
import json, threading, time

from draftwise.adaptive import DraftLengthPolicy
from draftwise.engine import Engine
from draftwise.estimates import StepCosts

_last = threading.local()


def _stale_widths(engine, rows):  # widths timed at this many rows whose timing is stale now
    costs = engine.draft_policy.costs
    timings = costs._verify_s.get(rows)
    return [] if timings is None else sorted(n for n in timings.seconds if timings.stale(n, costs.steps))


def install(out, mode_of):
    """Trace into the open file `out`; mode_of(engine, seqs or None) names the cell a line belongs to."""
    lock = threading.Lock()

    def write(record):
        with lock:
            out.write(json.dumps(dict(record, t=round(time.time(), 3))) + "\n")
            out.flush()

    orig_obs = StepCosts.observe

    def observe(self, rows, k, draft_s, verify_s, draft_steps=None):
        _last.obs = dict(getattr(_last, "obs", {}), k=k, steps=draft_steps)
        return orig_obs(self, rows, k, draft_s, verify_s, draft_steps)
    StepCosts.observe = observe

    orig_choose = DraftLengthPolicy.choose

    def choose(pol, rates, k_max, rows, fixed=(), spreads=(), free=()):
        k = orig_choose(pol, rates, k_max, rows, fixed, spreads, free)
        if pol.costs.measured and pol.costs.knows(rows, 1):
            _last.obs = dict(getattr(_last, "obs", {}), choice={
                "rates": [round(r, 3) for r in rates], "k": k, "free": list(free),
                "spreads": [round(x, 2) for x in spreads],
                "pred": [round(pol.rate(rates, j, rows, fixed, spreads, free), 1) for j in range(k_max + 1)],
                "verify": [round(1000 * pol.costs.verify(rows, n), 1) for n in range(1, k_max + 2)],
                "draft": round(1000 * pol.costs.draft(rows), 1)})
        return k
    DraftLengthPolicy.choose = choose

    orig_step = Engine.step

    def step(engine, seqs):
        _last.obs = {}
        t0 = time.perf_counter()
        ev = orig_step(engine, seqs)
        dt = time.perf_counter() - t0
        lt, obs = engine.last_step, _last.obs
        emitted = sum(sum(e.token_id is not None for e in ev[s]) for s in seqs)
        write({"mode": mode_of(engine, seqs), "rows": len(seqs), "draft_s": lt.draft_s, "verify_s": lt.verify_s,
               "k": obs.get("k"), "forwards": obs.get("steps"), "choice": obs.get("choice"), "total_s": dt,
               "emitted": emitted, "methods": [s.method for s in seqs], "wants": engine.draft_policy.wants_drafting,
               "stale": _stale_widths(engine, len(seqs)), "proposed": [s.stats.proposed for s in seqs],
               "behind": [s.draft_behind for s in seqs]})
        return ev
    Engine.step = step

    orig_catch = Engine.catch_up_draft

    def catch_up_draft(engine, seq, max_tokens=None):
        t0, behind = time.perf_counter(), seq.draft_behind
        orig_catch(engine, seq, max_tokens)
        pol = engine.draft_policy
        write({"mode": mode_of(engine, [seq]), "catch_up": behind, "s": time.perf_counter() - t0,
               "saving": pol.saving_per_token(engine.open_sequences), "open": engine.open_sequences,
               "cu_s": pol.costs.catch_up_s, "to_come": engine._tokens_to_come(seq)})
    Engine.catch_up_draft = catch_up_draft

    def timed(name):  # the scheduler's other calls into the engine: what a step's line does not show
        orig = getattr(Engine, name)

        def call(engine, *args, **kw):
            t0 = time.perf_counter()
            try:
                return orig(engine, *args, **kw)
            finally:
                write({"mode": mode_of(engine, None), "op": name, "s": time.perf_counter() - t0})
        setattr(Engine, name, call)
    for name in ("open_sequence", "prefill", "close_sequence"):
        timed(name)
