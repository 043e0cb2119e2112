"""Greedy identity on a real pretrained model: SmolLM2-135M-Instruct from the store (pulled on first use)."""
from __future__ import annotations

import functools

import pytest

from conftest import transformers_greedy
from draftwise import Engine
from draftwise.backends.kernels import EXACT_KERNELS

pytestmark = pytest.mark.real_model

NAME = "smollm2-135m-instruct"
PROMPTS = [
    "Repeat this sentence exactly, twice: the cat sat on the mat and looked at the hat.",
    "Write a Python function that returns the squares of a list of numbers.",
]
NEW_TOKENS = 40


@functools.lru_cache(maxsize=None)
def loaded():
    from draftwise.backends.hf import load_hf
    from draftwise.models import resolve

    source = resolve(NAME, progress=False).float_weights(progress=False)  # transformers' own weights
    # float32: identity with transformers' own greedy is the promise there. In bfloat16 (the `auto` dtype on a
    # CPU with AVX-512 BF16) a verification pass and a one-token step round differently, so a near-tie can go
    # either way (README, "What it guarantees").
    return load_hf(str(source.path), source.gguf_file, dtype="float32", progress=False)


@functools.lru_cache(maxsize=None)
def reference(prompt: str) -> list[int]:
    """transformers' own greedy generation on the same weights."""
    model, tokenizer = loaded()
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return transformers_greedy(model, tokenizer(text, add_special_tokens=False)["input_ids"], NEW_TOKENS)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["copying", "code"])
@pytest.mark.parametrize("method,k", [("lookup", 2), ("lookup", 4), ("draft", 3), ("none", 1)])
def test_real_greedy_output_is_the_targets_own(prompt, method, k):
    model, tokenizer = loaded()
    # A self-draft: the same weights behind a second backend, on kernels that keep their values (int8 ones would
    # not), so every token should be accepted.
    draft = model if method == "draft" else None
    engine = Engine.from_models(model, tokenizer, draft_model=draft, method=method, draft_kernels=EXACT_KERNELS)
    result = engine.generate(prompt, chat=True, max_new_tokens=NEW_TOKENS, num_draft_tokens=k, ignore_eos=True)
    assert result.token_ids == reference(prompt)
    if method == "draft":
        assert result.stats.acceptance_rate == 1.0
    if method == "lookup" and prompt == PROMPTS[0]:
        assert result.stats.accepted > 0  # the copied sentence is found in the prompt


def test_real_model_served_in_a_batch_gives_each_request_its_own_greedy_text():
    """SmolLM2 behind the server, 6 chat requests at once (lookup): each equals transformers' greedy alone."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from draftwise.serve.app import create_app
    from draftwise.serve.command import serve_in_thread
    from draftwise.serve.metrics import ServeMetrics
    from draftwise.serve.scheduler import Scheduler

    model, tokenizer = loaded()
    engine = Engine.from_models(model, tokenizer, method="lookup")
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=16, metrics=ServeMetrics())
    scheduler.start()
    url, stop = serve_in_thread(create_app(scheduler, NAME, scheduler.metrics))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    try:
        def ask(prompt):
            reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=NEW_TOKENS, temperature=0)
            return reply.choices[0].message.content, reply.choices[0].finish_reason

        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(ask, PROMPTS * 3))
    finally:
        stop()
        scheduler.drain(5)
    for prompt, (text, finish) in zip(PROMPTS * 3, replies):
        ids = reference(prompt)
        eos = set(engine.eos)
        cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))  # the server stops at EOS
        assert text == tokenizer.decode(ids[:cut], skip_special_tokens=True)
        assert finish == ("stop" if cut < len(ids) else "length")


def test_real_tokenizer_drafted_through_text_is_the_targets_own():
    """A draft with another tokenizer on a real vocabulary: SmolLM2 drafting for itself through a shuffle of its own
    49,152 ids (every id means another text), so its guesses reach the target only through their text. Greedy, the
    target's tokens; and most guesses kept, which they could not be if the text were read or spelled wrong."""
    from conftest import shuffled_tokenizer, shuffled_twin

    prompt = PROMPTS[1]
    model, tokenizer = loaded()
    other, order = shuffled_tokenizer(tokenizer)
    engine = Engine.from_models(model, tokenizer, draft_model=shuffled_twin(model, order), method="draft",
                                draft_tokenizer=other, compact_draft=False,  # (low ids are no longer the common ones)
                                draft_kernels=("dense",))
    assert engine.speed_paths["draft_tokenizer"] == "cross-tokenizer"
    result = engine.generate(prompt, chat=True, max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True,
                             adaptive=False)
    assert result.token_ids == reference(prompt)
    assert result.stats.acceptance_rate > 0.8
