"""Issue 58: engine.step on 6 rows opened as one method against 6 opened as another (adaptive), alternating: each
step's verify seconds, and whether it drafted.

.venv/bin/python docs/experiments/throttle-zen4/step_ab.py none,hybrid-tree 60"""
import json, os, statistics, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../.."))
from draftwise import Engine  # noqa: E402
from draftwise.config import GenerationConfig  # noqa: E402
from draftwise.tokenizers import encode_prompt  # noqa: E402

PROMPTS = os.path.join(os.path.dirname(__file__), "../invariance-zen4/prompts-unseen.jsonl")


def opened_rows(methods, rows=6, **options):
    """The Qwen pair on the quant backend, and per method `rows` sequences of the unseen prompts, prefilled."""
    engine = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "hybrid",
                                    backend="quant")
    prompts = [json.loads(line)["turns"][0] for line in open(PROMPTS)][:rows]
    ids = [encode_prompt(engine.tokenizer, p, chat=True) for p in prompts]

    def opened(method):
        cfg = GenerationConfig.from_options(temperature=0.0, method=method, **options)
        seqs = [engine.open_sequence(i, cfg) for i in ids]
        for seq in seqs:
            engine.prefill(seq)
        return seqs
    return engine, {m: opened(m) for m in methods}


def alternating(sets, repeats):
    """Each set's turn in every repeat, the order reversed on odd ones: [(method, its rows)] in the order they run."""
    for r in range(repeats):
        yield from (sets.items() if r % 2 == 0 else reversed(sets.items()))


def main():
    engine, sets = opened_rows(sys.argv[1].split(","), max_new_tokens=200, ignore_eos=True)
    stats = {m: [] for m in sets}
    for method, seqs in alternating(sets, int(sys.argv[2])):
        started = time.perf_counter()
        events = engine.step(seqs)
        total = time.perf_counter() - started
        emitted = sum(sum(e.token_id is not None for e in events[s]) for s in seqs)
        stats[method].append((engine.last_step.verify_s, engine.last_step.draft_s, total, emitted))
    for method, steps in stats.items():
        plain = [x for x in steps[4:] if x[3] == len(sets[method])]
        print(method, "steps", len(steps), "plain", len(plain),
              "verify median %.1f ms" % (1000 * statistics.median(x[0] for x in plain)),
              "total median %.1f" % (1000 * statistics.median(x[2] for x in plain)),
              "all steps %.2f s for %d tokens" % (sum(x[2] for x in steps), sum(x[3] for x in steps)))


if __name__ == "__main__":
    main()
