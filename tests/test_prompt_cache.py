"""The prompt cache: a prefix already computed is restored, not prefilled, and changes no output."""
from __future__ import annotations


import pytest
import torch

from conftest import FinalEvents, tiny_model, tiny_tokenizer
from draftwise import Engine
from draftwise.backends.prefix_cache import PrefixCache
from draftwise.config import GenerationConfig
from draftwise.serve.metrics import ServeMetrics
from draftwise.serve.scheduler import Scheduler

FIRST_TURN = "The quick brown fox jumps over the lazy dog. " * 3
NEXT_TURN = " Then the dog wakes up and chases the fox around the yard."


def engine(method="draft", arch="llama", cache_bytes: int | None = 64 << 20):
    draft = tiny_model(arch, 1) if method in ("draft", "hybrid") else None
    eng = Engine.from_models(tiny_model(arch, 0, 4 if method == "skip" else 2), tiny_tokenizer(), draft_model=draft,
                             method=method)
    if cache_bytes is not None:
        eng.enable_prompt_cache(cache_bytes)
    return eng


def ids(text: str) -> list[int]:
    return tiny_tokenizer()(text)["input_ids"]


def kv(length: int, layers: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.zeros(2, length, 4) for _ in range(layers)], [torch.zeros(2, length, 4) for _ in range(layers)]


# -- the store -------------------------------------------------------------------------------------------
def test_the_longest_common_prefix_wins_and_a_short_one_is_no_hit():
    cache = PrefixCache(1 << 20, min_tokens=4)
    cache.put("target", list(range(10)), *kv(10))
    cache.put("target", [0, 1, 2, 3, 4, 5, 99, 98], *kv(8))
    entry, n = cache.longest("target", [0, 1, 2, 3, 4, 5, 6, 7, 50])
    assert n == 8 and entry.token_ids == tuple(range(10))
    assert cache.longest("target", [0, 1, 2, 7]) == (None, 0)  # 3 tokens in common: under min_tokens
    assert cache.longest("draft", list(range(10))) == (None, 0)  # another model's entries never match
    stats = cache.stats["target"]
    assert (stats.lookups, stats.hits, stats.tokens_saved) == (2, 1, 8)


def test_the_least_recently_used_go_first_and_a_prefix_entry_gives_way_to_its_extension():
    one = kv(8)[0][0].numel() * 4 * 2 * 2  # bytes of an 8-token entry: keys and values, 2 layers, float32
    cache = PrefixCache(2 * one, min_tokens=4)
    cache.put("target", [1] * 8, *kv(8))
    cache.put("target", [2] * 8, *kv(8))
    cache.longest("target", [1] * 8)  # [1]*8 is now the most recently used
    cache.put("target", [3] * 8, *kv(8))
    assert len(cache) == 2 and cache.longest("target", [2] * 8) == (None, 0) and cache.nbytes == 2 * one
    cache.put("target", [3] * 8 + [4] * 4, *kv(12))  # extends [3]*8, which goes
    assert cache.longest("target", [3] * 8)[0].token_ids == tuple([3] * 8 + [4] * 4)
    cache.put("target", [5] * 40, *kv(40))  # over the whole budget: not kept, nothing evicted for it
    assert cache.longest("target", [5] * 40) == (None, 0) and cache.nbytes <= 2 * one
    with pytest.raises(ValueError, match=">= 0 bytes"):
        PrefixCache(-1)


# -- through the engine ----------------------------------------------------------------------------------
@pytest.mark.parametrize("method,arch", [("none", "llama"), ("draft", "llama"), ("hybrid", "qwen2"),
                                         ("skip", "llama"), ("draft", "mistral-sliding")])
def test_a_second_turn_from_the_cache_equals_a_cold_one(method, arch):
    warm, cold = engine(method, arch), engine(method, arch, cache_bytes=None)
    first = warm.generate(FIRST_TURN, max_new_tokens=12, ignore_eos=True)
    assert first.stats.prompt_cached == 0
    second_prompt = ids(FIRST_TURN) + first.token_ids + ids(NEXT_TURN)
    second = warm.generate(second_prompt, max_new_tokens=16, ignore_eos=True)
    # The first turn's text but its last token was in the cache when it ended.
    assert second.stats.prompt_cached == len(ids(FIRST_TURN)) + 12 - 1
    assert second.token_ids == cold.generate(second_prompt, max_new_tokens=16, ignore_eos=True).token_ids


@pytest.mark.parametrize("method", ["none", "draft"])
def test_a_turn_that_ended_on_a_stop_string_is_cached_too(method):
    """A chat's turn ends on EOS or a stop string, with the cache possibly holding draft tokens past it."""
    warm, cold = engine(method), engine(method, cache_bytes=None)
    whole = cold.generate(FIRST_TURN, max_new_tokens=24, ignore_eos=True)
    stop = whole.text[10:14]  # some text the greedy output reaches
    first = warm.generate(FIRST_TURN, max_new_tokens=24, ignore_eos=True, stop=[stop], num_draft_tokens=8)
    assert first.finish_reason == "stop"
    second_prompt = ids(FIRST_TURN) + first.token_ids + ids(NEXT_TURN)
    second = warm.generate(second_prompt, max_new_tokens=8, ignore_eos=True)
    assert second.stats.prompt_cached >= len(ids(FIRST_TURN))
    assert second.token_ids == cold.generate(second_prompt, max_new_tokens=8, ignore_eos=True).token_ids


def test_a_repeated_prompt_needs_no_prefill_and_the_draft_cache_matches_the_targets():
    eng = engine("draft")
    prompt = ids(FIRST_TURN)
    first = eng.generate(prompt, max_new_tokens=8, ignore_eos=True)
    seq = eng.open_sequence(prompt, GenerationConfig(max_new_tokens=8, ignore_eos=True))
    try:
        assert seq.prefill_done and seq.stats.prompt_cached == len(prompt) - 1
        assert seq.target.cache_len == len(prompt) - 1
        assert seq.proposer._cached == prompt[:-1] and seq.proposer.backend.cache_len == len(prompt) - 1
    finally:
        eng.close_sequence(seq)
    assert eng.generate(prompt, max_new_tokens=8, ignore_eos=True).token_ids == first.token_ids


def test_sampled_output_with_a_seed_is_the_same_warm_or_cold():
    warm, cold = engine("draft"), engine("draft", cache_bytes=None)
    options = dict(max_new_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    warm.generate(FIRST_TURN, **options)
    again = warm.generate(FIRST_TURN, **options)
    assert again.stats.prompt_cached > 0
    assert again.token_ids == cold.generate(FIRST_TURN, **options).token_ids


def test_without_the_cache_nothing_is_kept():
    eng = engine("draft", cache_bytes=None)
    eng.generate(FIRST_TURN, max_new_tokens=4, ignore_eos=True)
    assert eng.generate(FIRST_TURN, max_new_tokens=4, ignore_eos=True).stats.prompt_cached == 0


def test_the_servers_metrics_count_lookups_hits_and_saved_tokens():
    metrics = ServeMetrics()
    eng = engine("draft")
    scheduler = Scheduler(eng, max_batch=2, prefill_chunk=8, metrics=metrics)
    scheduler.start()
    finals = FinalEvents()
    prompt = ids(FIRST_TURN)
    for _ in range(2):  # one after the other: the second finds the first's text
        scheduler.submit(prompt, GenerationConfig(max_new_tokens=6, ignore_eos=True), finals.sink)
        assert finals.wait()
    scheduler.drain(5)
    value = metrics.registry.get_sample_value
    assert value("draftwise_prompt_cache_lookups_total") == 2 and value("draftwise_prompt_cache_hits_total") == 1
    assert value("draftwise_prompt_cache_saved_tokens_total") == finals.events[1].stats.prompt_cached == len(prompt) - 1
    assert value("draftwise_prompt_cache_bytes") == eng.prompt_cache.nbytes > 0
