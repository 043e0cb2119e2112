"""Everyday requests for the head to learn from: the kinds of things people ask a chat model outside code, on a
hand-written list of everyday topics, answered by the target itself (answers.target_answers).

Why: the package corpus (corpus.py) is code and technical English, and the requests built from it (answers.py) keep
its subjects. A head trained on them alone guesses the target's next token on held-back answers about package files
far better than on what users ask: it keeps its guesses on code, but far fewer on news summaries, translation
and questions, which are most of what a chat model is asked. Everyday answers added to its training close much of
that gap without costing it the code. The requests ask for prose, translation
into English, summaries of a text the answer writes first (so the summary has a longer text above it to draw on, as
a summary of a user's article does), short factual answers, advice, worked arithmetic and dialogue. Nothing here
comes from a benchmark: the topics are ours, and the request kinds are those of any chat model's users.

Each request is one seeded choice of kind, topic and language, so the same count gives the same requests; its
source, which the train/validation split goes by, is its topic, so a held-back topic is held back in every kind.
"""
from __future__ import annotations

import hashlib
import json
import random

REQUESTS = (
    "Write a short news report of about 150 words on {topic}. Then summarize it in two or three sentences.",
    "Write a paragraph of about 80 words in {language} on {topic}. Then translate it into English.",
    "Write a short article of about 150 words on {topic}, then list its three key points.",
    "What should someone know about {topic}? Answer in a few sentences.",
    "A friend asks for advice about {topic}. What would you tell them? Give a short, practical answer.",
    "Make up a word problem about {topic} that takes three steps of arithmetic, then solve it step by step and give "
    "the final answer.",
    "Write a short conversation between two people about {topic}.",
    "Explain {topic} to a ten-year-old in a short paragraph.",
    "Write a short, polite email to a neighbour about {topic}.",
    "Give three questions someone might ask about {topic}, and answer each in one or two sentences.",
)
LANGUAGES = ("German", "French", "Spanish", "Italian", "Chinese", "Japanese")
TOPICS = (
    "a town opening a new cycle lane", "a bakery opening its second shop", "the first snow of the winter",
    "a village football match", "a library extending its opening hours", "a solar farm built beside a motorway",
    "a museum showing old maps", "a school science fair", "a regional train strike", "a summer heat wave",
    "a company that recycles old batteries", "a city marathon", "a newly discovered species of frog",
    "a farmers' market in the rain", "a power cut in a small city", "a community garden", "a bridge closed for repairs",
    "a music festival by a lake", "rising rents in a capital city", "a hospital opening a new wing",
    "a flood after a week of storms", "a chess tournament for children", "a ferry service that restarts in spring",
    "a zoo welcoming a baby elephant", "a new airport terminal", "a bookshop that survived for a hundred years",
    "a wildfire in dry hills", "a local election with a close result", "a factory switching to electric vans",
    "a fishing harbour with fewer boats each year", "a volunteer beach clean-up", "a theatre reopening after works",
    "learning to bake bread", "saving money on groceries", "keeping houseplants alive", "training for a first 10 km run",
    "moving to a new city", "learning a second language as an adult", "sleeping better", "planning a family holiday",
    "starting a vegetable patch", "buying a used car", "caring for an old dog", "preparing for a job interview",
    "making friends at a new school", "cooking for a large group", "repairing a bicycle puncture",
    "keeping a home warm in winter", "the water cycle", "how vaccines work", "why the sky is blue", "how bees make honey",
    "how a bill becomes law", "the history of the printing press", "how tides work", "the causes of inflation",
    "how airplanes stay in the air", "the life of a star", "how rainbows form", "what causes earthquakes",
    "how the heart pumps blood", "the invention of the telephone", "why leaves change colour in autumn",
    "how recycling plants sort waste", "a shop selling bicycles and coffee", "a school trip to a castle",
    "a charity run for a children's hospital", "renting a flat for the first time", "a neighbour's noisy renovation",
    "a lost cat found after a week", "a wedding planned on a small budget", "the price of concert tickets",
)


def everyday_key() -> str:
    """A digest of what shapes the requests, for the saved answers' key: answers to other requests are not reused."""
    return hashlib.sha256(json.dumps([REQUESTS, LANGUAGES, TOPICS]).encode()).hexdigest()[:12]


def everyday_prompts(count: int, seed: int = 0) -> list[tuple[str, list[dict]]]:
    """count (source "everyday/<topic>", chat request of one user message)."""
    rng = random.Random(f"everyday-{seed}")
    requests = []
    for _ in range(count):
        topic = rng.choice(TOPICS)
        request = rng.choice(REQUESTS).format(topic=topic, language=rng.choice(LANGUAGES))
        requests.append((f"everyday/{topic}", [{"role": "user", "content": request}]))
    return requests
