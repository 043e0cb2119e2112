"""Issue 58: the server's scheduler in-process (no HTTP), C requests in flight, modes on/off/always interleaved;
one JSON line per step (rows, draft and verify seconds, tokens emitted, the policy's inputs and prices) and per draft
catch-up, for steps_summary.py.

.venv/bin/python docs/experiments/throttle-zen4/inprocess_load.py --backend quant --method hybrid --c 4 --repeats 2 --log steps.jsonl
"""
import argparse, json, statistics, sys, threading, time
from draftwise import Engine
from draftwise.config import GenerationConfig
from draftwise.serve.scheduler import Scheduler
from draftwise.tokenizers import encode_prompt

ap = argparse.ArgumentParser()
ap.add_argument("--method", default="hybrid")
ap.add_argument("--request-method", default=None, help="the method requests ask for (default: the engine's own)")
ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
ap.add_argument("--c", type=int, default=4)
ap.add_argument("--backend", default="hf")
ap.add_argument("--modes", default="on,off,always")
ap.add_argument("--repeats", type=int, default=1)
ap.add_argument("--max-tokens", type=int, default=96)
ap.add_argument("--prompts", default="docs/experiments/invariance-zen4/prompts-unseen.jsonl")
ap.add_argument("--log", default="/tmp/w/steps.jsonl")
ap.add_argument("--served-before", default="", help="methods whose `on` cells run before each repeat's modes, as the "
                "server table's earlier methods do (logged as before-METHOD)")
ap.add_argument("--before-c", type=int, default=None, help="requests in flight in those cells (default: --c)")
a = ap.parse_args()

engine = Engine.from_pretrained(a.target, a.draft if a.draft != "none" else None, a.method, backend=a.backend)
prompts = [json.loads(l)["turns"][0] for l in open(a.prompts)]
ids = [encode_prompt(engine.tokenizer, p, chat=True) for p in prompts]
sched = Scheduler(engine, max_batch=8)
out = open(a.log, "w")
mode_now = {"m": None}

# Wrap the step and the catch-up to log them.
orig_step, orig_catch = engine.step, engine.catch_up_draft
last_obs = {}
orig_obs = engine.draft_policy.costs.observe
def obs(rows, k, draft_s, verify_s, draft_steps=None):
    last_obs.update(k=k, steps=draft_steps)
    return orig_obs(rows, k, draft_s, verify_s, draft_steps)
engine.draft_policy.costs.observe = obs
orig_choose = engine.draft_policy.choose
def choose(rates, k_max, rows, fixed=(), spreads=(), free=()):
    k = orig_choose(rates, k_max, rows, fixed, spreads, free)
    pol = engine.draft_policy
    if pol.costs.measured and pol.costs.knows(rows, 1):
        last_obs["choice"] = {"rates": [round(r, 3) for r in rates], "k": k, "free": list(free),
                              "pred": [round(pol.rate(rates, j, rows, fixed, spreads, free), 1) for j in range(k_max + 1)],
                              "verify": [round(1000 * pol.costs.verify(rows, n), 1) for n in range(1, k_max + 2)],
                              "draft": round(1000 * pol.costs.draft(rows), 1)}
    return k
engine.draft_policy.choose = choose
def step(seqs):
    last_obs.clear()
    pol = engine.draft_policy
    t0 = time.perf_counter()
    ev = orig_step(seqs)
    dt = time.perf_counter() - t0
    lt = engine.last_step
    emitted = sum(sum(e.token_id is not None for e in ev[s]) for s in seqs)
    out.write(json.dumps({"mode": mode_now["m"], "rows": len(seqs), "draft_s": lt.draft_s, "verify_s": lt.verify_s,
                          "k": last_obs.get("k"), "forwards": last_obs.get("steps"), "choice": last_obs.get("choice"),
                          "total_s": dt, "emitted": emitted, "methods": [s.method for s in seqs],
                          "wants": pol.wants_drafting,
                          "proposed": [s.stats.proposed for s in seqs]}) + "\n")
    return ev
def catch(seq, max_tokens=None):
    t0 = time.perf_counter(); b = seq.draft_behind
    orig_catch(seq, max_tokens)
    pol = engine.draft_policy
    out.write(json.dumps({"mode": mode_now["m"], "catch_up": b, "s": time.perf_counter() - t0,
                          "saving": pol.saving_per_token(engine.open_sequences), "open": engine.open_sequences, "cu_s": pol.costs.catch_up_s, "to_come": engine._tokens_to_come(seq),
                          "running": len(sched._running)}) + "\n")
engine.step, engine.catch_up_draft = step, catch

def timed(name):  # the scheduler's other calls into the engine, timed: what a step's log does not show
    orig = getattr(engine, name)
    def call(*args, **kw):
        t0 = time.perf_counter()
        try:
            return orig(*args, **kw)
        finally:
            out.write(json.dumps({"mode": mode_now["m"], "op": name, "s": time.perf_counter() - t0}) + "\n")
    setattr(engine, name, call)
for name in ("open_sequence", "prefill", "close_sequence"):
    timed(name)

def run_mode(mode, method=None, c=None):
    method = method or a.request_method
    asked = {} if method is None else {"method": method}
    cfg = {"on": dict(asked), "always": dict(asked, adaptive=False), "off": dict(method="none")}[mode]
    cfg = GenerationConfig.from_options(max_new_tokens=a.max_tokens, temperature=0.0, ignore_eos=False, **cfg)
    todo = list(range(len(ids)))
    done = threading.Event(); lock = threading.Lock(); state = {"inflight": 0, "tokens": 0, "left": len(ids)}
    def sink_for(i):
        def sink(ev):
            if ev.token_id is not None:
                state["tokens"] += 1
            if ev.finish_reason is not None:
                if ev.finish_reason == "error": print("ERROR", ev.error, file=sys.stderr, flush=True)
                with lock:
                    state["inflight"] -= 1; state["left"] -= 1
                    if todo:
                        j = todo.pop(0); state["inflight"] += 1
                        sched.submit(ids[j], cfg, sink_for(j))
                    if state["left"] == 0:
                        done.set()
        return sink
    t0 = time.perf_counter()
    with lock:
        for _ in range(min(c or a.c, len(todo))):
            j = todo.pop(0); state["inflight"] += 1
            sched.submit(ids[j], cfg, sink_for(j))
    done.wait()
    return state["tokens"], time.perf_counter() - t0

results = {}
def driver():
    for r in range(a.repeats + 1):
        order = a.modes.split(",")
        if r % 2: order = order[::-1]
        for other in filter(None, a.served_before.split(",")):
            mode_now["m"] = f"before-{other}"
            tok, wall = run_mode("on", other, a.before_c)
            print(f"repeat {r} {other} on: {tok} tokens in {wall:.1f}s = {tok/wall:.2f} tok/s", file=sys.stderr, flush=True)
        for mode in order:
            mode_now["m"] = f"{mode}" if r else f"warm-{mode}"
            tok, wall = run_mode(mode)
            if r:
                results.setdefault(mode, []).append(tok / wall)
            print(f"repeat {r} {mode}: {tok} tokens in {wall:.1f}s = {tok/wall:.2f} tok/s", file=sys.stderr, flush=True)
    sched.drain(5)
threading.Thread(target=driver, daemon=True).start()
sched.run()
out.close()
print(json.dumps({m: statistics.median(v) for m, v in results.items()}))
