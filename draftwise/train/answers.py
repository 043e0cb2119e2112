"""The target's own answers, for the head to train on: requests built from the corpus, answered greedily by the target.

Why: at generation time the head reads the target's features over the target's *own* text. Teacher-forced on
someone else's text, the features and the next tokens follow another distribution, and a head that scores well
there can score poorly on what the target writes, however well it scores on the corpus's text. Answers from
the target close that gap, at the price of generating them.

The requests are built from the same package files as the corpus (corpus.py; never a benchmark prompt): explain
a piece of code, summarize or translate a passage of documentation, answer a question about it, write code
like it, work a small arithmetic problem on its topic, write an email or a story about it, or give its most useful
fact in a sentence or two. Which file and which kind of request is a seeded choice, so the same count gives the
same requests.
"""
from __future__ import annotations

import hashlib
import json
import random

import torch
from tqdm import tqdm

from draftwise.train.corpus import Piece, corpus_texts, package_roots

REQUESTS = (
    "Explain what the following code does, step by step.\n\n{text}",
    "Summarize the following text in a short paragraph.\n\n{text}",
    "Translate the following text into {language}.\n\n{text}",
    "Read the following and answer: what is it for, and how would someone use it?\n\n{text}",
    "Write a short Python function in the style of the following, with a docstring.\n\n{text}",
    "List the three most important points of the following.\n\n{text}",
    # Kinds of answer the requests above never ask for, though users do: arithmetic worked step by step, letters
    # and stories, short factual answers. The text only sets the topic.
    "Make up a short arithmetic word problem about the topic of the following, then solve it step by step.\n\n{text}",
    "Write a short, friendly email to a colleague about the following.\n\n{text}",
    "Write a very short story inspired by the following.\n\n{text}",
    "In one or two sentences, answer: what is the single most useful fact in the following?\n\n{text}",
)
LANGUAGES = ("German", "French", "Spanish", "Chinese")
EXCERPT_CHARS = 700  # long enough to ask about, short enough that answering, not reading, is the cost


def requests_key() -> str:
    """A digest of what shapes the requests, for the saved answers' key: answers to other requests are not reused."""
    return hashlib.sha256(json.dumps([REQUESTS, LANGUAGES, EXCERPT_CHARS]).encode()).hexdigest()[:12]


def answer_prompts(count: int, seed: int = 0, roots=None) -> list[tuple[str, list[dict]]]:
    """count (source file, chat request of one user message) built from corpus excerpts."""
    rng = random.Random(seed)
    requests = []
    for label, text in corpus_texts(package_roots() if roots is None else roots):
        if len(requests) >= count:
            break
        start = rng.randrange(max(1, len(text) - EXCERPT_CHARS))
        excerpt = text[start : start + EXCERPT_CHARS].strip()
        if len(excerpt) < 200:
            continue
        request = rng.choice(REQUESTS).format(text=excerpt, language=rng.choice(LANGUAGES))
        requests.append((label, [{"role": "user", "content": request}]))
    return requests


@torch.inference_mode()
def target_answers(model, tokenizer, requests: list[tuple[str, list[dict]]], max_new_tokens: int,
                   batch_size: int = 16, progress: bool = True) -> list[Piece]:
    """Each (source, request)'s chat-templated prompt followed by the target's greedy answer (cut after its end
    token), as a Piece whose answer starts where the prompt ends. batch_size 16: wider batches answer faster on a
    CPU until the matrix kernels are busy, and past 16 rows they gain little while the padding of unequal answers
    grows."""
    prompts = [_prompt_ids(tokenizer, messages) for _source, messages in requests]
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)
    out: list[Piece] = []
    sources = iter(source for source, _messages in requests)
    with tqdm(total=len(prompts), desc="target answers", unit="answer", disable=not progress, dynamic_ncols=True) as bar:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            width = max(map(len, batch))
            # Left padding: every row's answer starts at the same column.
            input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=model.device)  # [B, W]
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
            generated = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                       eos_token_id=list(eos) or None, pad_token_id=pad, temperature=None,
                                       top_p=None, top_k=None)  # [B, W + new]
            for prompt, row in zip(batch, generated[:, width:].tolist()):
                end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
                out.append(Piece(next(sources), prompt + row[:end], len(prompt)))
            bar.update(len(batch))
    return out


def _prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))
    return tokenizer(messages[-1]["content"])["input_ids"]


def _eos_ids(model, tokenizer) -> set[int]:
    from draftwise.tokenizers import eos_ids

    return set(eos_ids(tokenizer, model.generation_config, model.config))
