"""How often a draft's guess is kept under each sampled rule, teacher-forced on the target's own sampled text:

- rejection sampling with the draft's q at temperature T (and at lower draft temperatures): sum min(p, q);
- a one-hot guess of the draft's argmax (p(argmax q)), and of its top 2 and top 3 as a tree's children;
- shared noise (shared_noise.py): the draft's Gumbel-max draw on the target's noise equals the target's, measured
  over 4 draws of the noise per position.

    .venv/bin/python docs/experiments/tools/shared_noise_acceptance.py [--temperature 0.7] [--tokens 128]

The prompts are ordinary requests written for this record (none from a benchmark set); the text is `none`'s sampled
answer to each, seeded by its index, and both models score it in one pass each on the quant backend."""
from __future__ import annotations

import argparse
import statistics

import torch

from draftwise import Engine
from draftwise.tokenizers import encode_prompt

PROMPTS = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Explain what a mutex is and when a program needs one.",
    "Write a bash script that counts the lines of every .py file under a folder and prints the total.",
    "Describe the difference between TCP and UDP for a new programmer.",
    "Write a JavaScript function that debounces another function.",
    "What are the trade-offs of storing timestamps as UTC in a database?",
    "Write a SQL query that finds the five customers with the highest total order value.",
    "Summarize how garbage collection works in Java in a few paragraphs.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    temperature = args.temperature
    eng = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", method="draft",
                                 backend="quant", progress=False)
    kept: dict[str, list[float]] = {}
    for i, prompt in enumerate(PROMPTS):
        messages = [{"role": "user", "content": prompt}]
        answer = eng.generate(messages, chat=True, max_new_tokens=args.tokens, temperature=temperature, seed=100 + i,
                              method="none", ignore_eos=True).token_ids
        ids = encode_prompt(eng.tokenizer, messages, chat=True)
        feed = [ids[-1], *answer[:-1]]  # each row scores the next token of the answer
        rows = []
        for backend in (eng.target, eng.proposer.backend):
            slot = backend.open_slot()
            slot.prefill(ids[:-1])
            rows.append(slot.forward(feed).float())
            slot.close()
        width = min(rows[0].shape[-1], rows[1].shape[-1], len(eng.tokenizer))
        target, draft = (row[:, :width] for row in rows)  # [n, vocab] each
        p = torch.softmax(target / temperature, -1)
        for name, scale in (("rejection, q at T", 1.0), ("rejection, q at 0.75 T", 0.75),
                            ("rejection, q at 0.5 T", 0.5)):
            q = torch.softmax(draft / (temperature * scale), -1)
            kept.setdefault(name, []).extend(torch.minimum(p, q).sum(-1).tolist())
        top = draft.topk(3, -1).indices
        at_top = p.gather(-1, top)  # [n, 3]
        for name, n in (("one-hot argmax", 1), ("one-hot top 2 (tree)", 2), ("one-hot top 3 (tree)", 3)):
            kept.setdefault(name, []).extend(at_top[:, :n].sum(-1).tolist())
        for _ in range(4):
            noise = -torch.log(torch.empty_like(p).exponential_())  # Gumbel [n, vocab]
            drawn = (torch.log_softmax(target / temperature, -1) + noise).argmax(-1)
            guessed = (torch.log_softmax(draft / temperature, -1) + noise).argmax(-1)
            kept.setdefault("shared noise", []).extend((drawn == guessed).float().tolist())
        kept.setdefault("greedy: argmax agrees", []).extend((target.argmax(-1) == draft.argmax(-1)).float().tolist())
        print(f"prompt {i + 1}/{len(PROMPTS)}", flush=True)
    print(f"temperature {temperature}, {len(PROMPTS)} prompts x {args.tokens} positions")
    print("| rule | a guess kept, mean over positions |")
    print("| --- | ---: |")
    for name, values in kept.items():
        print(f"| {name} | {statistics.mean(values):.3f} |")


if __name__ == "__main__":
    main()
