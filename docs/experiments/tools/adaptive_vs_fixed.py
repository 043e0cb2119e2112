"""Greedy `draft`: adaptive k against fixed k = 2 and 3 and `none`, on prompts written for this record (ordinary
writing, questions, and answers from a document: two of the project's own docs pages as the document):

    .venv/bin/python docs/experiments/tools/adaptive_vs_fixed.py [--arms none,adaptive,k2,k3]
        [--served [--warm-tokens N]]

Per prompt and arm: decode ms a token, draft tokens kept over offered, rounds, and rounds that drafted; then each
arm over every prompt. The arms run in turn on each prompt, on one engine (the quant backend). --served: each
request goes through a server's scheduler, one in flight, and the arm `unmarked` is `adaptive` with the scheduler's
_mark_alone disabled (a lone request neither filled before probes nor priced so: the scheduler before 2026-12-04)."""
from __future__ import annotations

import argparse
import threading

from draftwise import Engine
from draftwise.config import GenerationConfig
from draftwise.serve.scheduler import Scheduler
from draftwise.tokenizers import encode_prompt

ARMS = {"none": dict(method="none"), "adaptive": dict(method="draft"),
        "k2": dict(method="draft", adaptive=False, num_draft_tokens=2),
        "k3": dict(method="draft", adaptive=False, num_draft_tokens=3), "unmarked": dict(method="draft")}


def prompts() -> list[tuple[str, str]]:
    def from_document(path: str, question: str) -> str:
        return f"Here is a document:\n\n{open(path).read()[:6000]}\n\n{question}"

    return [
        ("write", "Write a short essay on how public libraries changed in the last thirty years."),
        ("write", "Write a letter to a friend describing a weekend hiking trip in the mountains."),
        ("qa", "Why do leaves change colour in autumn?"),
        ("qa", "What is the difference between weather and climate?"),
        ("doc", from_document("docs/serving.md",
                              "Based on the document, explain how the server handles a bad request.")),
        ("doc", from_document("docs/architecture.md", "Summarize the layers described in this document.")),
    ]


def served(eng: Engine, prompt: str, marked: bool, **options):
    """The stats of one request served alone by a scheduler on eng (its _mark_alone disabled if not marked)."""
    scheduler = Scheduler(eng, max_batch=4)
    if not marked:
        scheduler._mark_alone = lambda: None
    finished, last = threading.Event(), []

    def sink(event):
        if event.finish_reason is not None:
            last.append(event)
            finished.set()

    ids = encode_prompt(eng.tokenizer, [{"role": "user", "content": prompt}], True, False)
    scheduler.submit(ids, GenerationConfig.from_options(**options), sink)
    scheduler.start()
    finished.wait()
    scheduler.drain(10)
    return last[0].stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="none,adaptive,k2,k3", help=f"of {', '.join(ARMS)}")
    parser.add_argument("--served", action="store_true", help="each request through a scheduler, one in flight")
    parser.add_argument("--warm-tokens", type=int, default=128,
                        help="--served: the first (uncounted) request's answer length, which later ones are expected "
                             "to run (8: a server whose first request was short; 0: warm with generate, as unserved)")
    args = parser.parse_args()
    arms = {name: ARMS[name] for name in args.arms.split(",")}
    eng = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", method="draft",
                                 backend="quant", progress=False)
    # (Warm, as a server's first request would: its answer's length is what later ones expect.)
    if args.served and args.warm_tokens:
        served(eng, "Write a haiku about rivers, then explain it.", True, method="draft",
               max_new_tokens=args.warm_tokens, ignore_eos=True)
    else:
        eng.generate("def f(x):", max_new_tokens=8)  # (warm: the first pass is timed apart)
    totals = {name: [0.0, 0, 0, 0, 0] for name in arms}  # decode s, tokens, kept, offered, rounds
    for kind, prompt in prompts():
        cells = [kind]
        for name, options in arms.items():
            if args.served:
                stats = served(eng, prompt, name != "unmarked", max_new_tokens=128, ignore_eos=True, **options)
            else:
                stats = eng.generate([{"role": "user", "content": prompt}], chat=True, max_new_tokens=128,
                                     ignore_eos=True, **options).stats
            for i, value in enumerate((stats.decode_s, stats.new_tokens, stats.accepted, stats.proposed, stats.rounds)):
                totals[name][i] += value
            drafted = stats.proposed_at[0] if stats.proposed_at else 0
            cells.append(f"{name} {stats.decode_s / stats.new_tokens * 1e3:.1f} ms kept {stats.accepted}/"
                         f"{stats.proposed} rounds {stats.rounds} drafted {drafted}")
        print(" | ".join(cells), flush=True)
    for name, (seconds, tokens, kept, offered, rounds) in totals.items():
        print(f"{name}: {seconds / tokens * 1e3:.1f} ms/token kept {kept}/{offered} rounds {rounds}")


if __name__ == "__main__":
    main()
