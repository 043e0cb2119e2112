"""Issue 58: the server's scheduler in-process (no HTTP), C requests in flight, modes on/off/always interleaved;
each step, catch-up and scheduler call traced (step_trace.py), for steps_summary.py.

.venv/bin/python docs/experiments/throttle-zen4/inprocess_load.py --backend quant --method hybrid --c 4 --repeats 2 --log steps.jsonl
"""
import argparse, json, os, statistics, sys, threading, time
sys.path.insert(0, os.path.dirname(__file__))
import step_trace
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
ap.add_argument("--table", default="", help="methods: play loadgen's cells in its order instead (every level of "
                "--levels, each repeat's (mode, method) cells as LoadPlan.schedule orders them), logged as "
                "c{C}-{method}-{mode}-r{repeat}")
ap.add_argument("--levels", default="1,2,4,8")
a = ap.parse_args()

engine = Engine.from_pretrained(a.target, a.draft if a.draft != "none" else None, a.method, backend=a.backend)
prompts = [json.loads(l)["turns"][0] for l in open(a.prompts)]
ids = [encode_prompt(engine.tokenizer, p, chat=True) for p in prompts]
sched = Scheduler(engine, max_batch=8)
out = open(a.log, "w")
mode_now = {"m": None}

step_trace.install(out, lambda engine, seqs: mode_now["m"])

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
def table_driver():  # loadgen's order (draftwise/bench/loadgen.py): levels, then repeats, then the repeat's cells
    from draftwise.bench.loadgen import LoadPlan
    methods = tuple(a.table.split(","))
    plan = LoadPlan(url="http://127.0.0.1:1", prompts=prompts, levels=[int(c) for c in a.levels.split(",")],
                    modes=("on", "always", "off"), methods=methods, repeats=a.repeats)
    for level in plan.levels:
        for repeat, _, mode, method in plan.schedule(level):  # (one slice: every prompt in each cell)
            mode_now["m"] = f"c{level}-{method}-{mode}-r{repeat}"
            tok, wall = run_mode(mode, method, level)
            results.setdefault(f"c{level}-{method}-{mode}", []).append(tok / wall)
            print(f"{mode_now['m']}: {tok} tokens in {wall:.1f}s = {tok/wall:.2f} tok/s", file=sys.stderr, flush=True)
    sched.drain(5)
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
threading.Thread(target=table_driver if a.table else driver, daemon=True).start()
sched.run()
out.close()
print(json.dumps({m: statistics.median(v) for m, v in results.items()}))
