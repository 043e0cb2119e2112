"""Measure the server's two caches on the default pair, in one process, interleaved (docs/serving.md describes both).

  proposal: a templated workload (the same instruction about different records, as a form-filling service
            sends), served one request after another: prompt lookup alone against lookup with the proposal
            cache (the texts of the requests before), and the hybrid with it; acceptance and decode tokens/s.
  prompt:   time to first token of a chat's second turn, with the first turn's keys and values in the prompt
            cache (warm) and without (cold), median of several trials.

The records are made up here (names, cities and roles from small lists): nothing a benchmark measures.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from draftwise import Engine
from draftwise.config import DEFAULT_DRAFT, DEFAULT_TARGET
from draftwise.loading import load_models

NAMES = ["Alice Moreau", "Bilal Haddad", "Chen Wei", "Dana Kowalski", "Emeka Obi", "Freya Lind", "Goran Petrov",
         "Hana Sato", "Ines Duarte", "Jonas Berg", "Kamala Rao", "Luis Ortega"]
CITIES = ["Lyon", "Porto", "Gdansk", "Osaka", "Lagos", "Bergen", "Leeds", "Cusco", "Graz", "Tartu", "Pune", "Quito"]
ROLES = ["engineer", "nurse", "teacher", "chef", "pilot", "designer", "analyst", "welder", "baker", "librarian"]
TEMPLATE = ("Convert this employee record to a JSON object with the keys name, age, city, role, email and "
            "active. Use lowercase first.last@example.com for the email. Reply with the JSON only.\n"
            "Record: name={name}; age={age}; city={city}; role={role}; active=yes")
SYSTEM = ("You are a careful assistant for a hardware store's support desk. Answer briefly and precisely. "
          "Store policies: returns within 30 days with a receipt; power tools carry a two-year warranty; "
          "orders over 50 euros ship free; paint is mixed to order and cannot be returned; rental tools need "
          "a deposit of 100 euros and an ID; the store opens 8:00 to 19:00 on weekdays and 9:00 to 17:00 on "
          "Saturdays, and is closed on Sundays and public holidays. ") * 3


def templated_prompts(count: int) -> list[str]:
    return [TEMPLATE.format(name=NAMES[i % len(NAMES)], age=24 + 3 * i, city=CITIES[i % len(CITIES)],
                            role=ROLES[i % len(ROLES)]) for i in range(count)]


def measure_proposal_cache(target, tokenizer, draft, requests: int, new_tokens: int) -> None:
    arms = {"lookup": Engine.from_models(target, tokenizer, method="lookup"),
            "lookup+cache": Engine.from_models(target, tokenizer, method="lookup"),
            "hybrid": Engine.from_models(target, tokenizer, draft_model=draft, method="hybrid"),
            "hybrid+cache": Engine.from_models(target, tokenizer, draft_model=draft, method="hybrid")}
    for name, engine in arms.items():
        if name.endswith("+cache"):
            engine.enable_proposal_cache(1 << 16)
    rows = {name: [] for name in arms}
    texts = {}
    for i, prompt in enumerate(templated_prompts(requests)):
        order = list(arms)[i % len(arms):] + list(arms)[: i % len(arms)]  # rotate who goes first
        for name in order:
            result = arms[name].generate(prompt, chat=True, max_new_tokens=new_tokens, num_draft_tokens=8)
            texts.setdefault(i, set()).add(tuple(result.token_ids))
            rows[name].append(result.stats)
        print(f"request {i + 1}/{requests} done", file=sys.stderr)
    same = all(len(outputs) == 1 for outputs in texts.values())
    print(f"\nproposal cache: {requests} templated requests, {new_tokens} new tokens, greedy; the first request "
          f"(nothing cached yet) left out of the figures; outputs identical across methods: {same}")
    print("| method | acceptance | mean accepted length | decode tok/s (median) |")
    print("|---|---:|---:|---:|")
    for name, stats in rows.items():
        later = stats[1:]
        proposed, accepted = sum(s.proposed for s in later), sum(s.accepted for s in later)
        rounds = sum(s.rounds for s in later)
        print(f"| {name} | {accepted / max(proposed, 1):.1%} | {(accepted + rounds) / max(rounds, 1):.2f} | "
              f"{statistics.median(s.tokens_per_s for s in later):.2f} |")


def measure_prompt_cache(target, tokenizer, draft, trials: int, new_tokens: int) -> None:
    engine = Engine.from_models(target, tokenizer, draft_model=draft, method="draft")
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Can I return a can of paint I bought last week?"}]
    answer = engine.generate(first, chat=True, max_new_tokens=new_tokens).text
    second = first + [{"role": "assistant", "content": answer},
                      {"role": "user", "content": "And a drill I bought three weeks ago?"}]
    warm, cold, reused = [], [], 0
    for _ in range(trials):
        for kind in ("warm", "cold"):
            engine.enable_prompt_cache(1 << 30)  # a fresh, empty cache
            if kind == "warm":
                engine.generate(first, chat=True, max_new_tokens=new_tokens)  # turn one fills it
            started = time.perf_counter()
            result = engine.generate(second, chat=True, max_new_tokens=1)  # prefill and the first token
            (warm if kind == "warm" else cold).append(time.perf_counter() - started)
            reused = max(reused, result.stats.prompt_cached)
    print(f"\nprompt cache: second turn of a chat, {result.stats.prompt_tokens} prompt tokens, {reused} restored "
          f"from the cache when warm; time to first token, median of {trials}: warm "
          f"{statistics.median(warm):.2f} s, cold {statistics.median(cold):.2f} s "
          f"({statistics.median(cold) / statistics.median(warm):.1f}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("proposal", "prompt", "both"))
    parser.add_argument("--requests", type=int, default=8, help="templated requests (default: %(default)s)")
    parser.add_argument("--trials", type=int, default=3, help="prompt cache trials (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=80, help="(default: %(default)s)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="(default: %(default)s)")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="(default: %(default)s)")
    parser.add_argument("--dtype", default="auto", help="(default: %(default)s)")
    args = parser.parse_args(argv)
    target, tokenizer, draft, _ = load_models(args.target, args.draft, args.dtype)
    target = Engine.from_models(target, tokenizer, method="none").target.model  # one calibrated copy for all
    if args.what in ("proposal", "both"):
        measure_proposal_cache(target, tokenizer, draft, args.requests, args.max_new_tokens)
    if args.what in ("prompt", "both"):
        measure_prompt_cache(target, tokenizer, draft, args.trials, args.max_new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
