"""The proposal cache: prompt lookup proposes from the texts of earlier requests, bounded, and changes no output.

Sampled exactness with it is in test_sampling_e2e.py (lookup-corpus)."""
from __future__ import annotations

import pytest

from conftest import tiny_model, tiny_tokenizer
from draftwise import Engine
from draftwise.config import GenerationConfig
from draftwise.proposers import HybridProposer, PromptLookupProposer
from draftwise.proposers.proposal_cache import ProposalCache
from test_batch import run_together

TEMPLATE = "Record {n}: status=active; owner=ops-team; region=eu-west; tier=gold; notes=none."


def ids(text: str) -> list[int]:
    return tiny_tokenizer()(text)["input_ids"]


# -- the store -------------------------------------------------------------------------------------------
def test_the_longest_ngram_match_proposes_what_followed_it():
    cache = ProposalCache(1000, ngrams=(2, 3))
    cache.add([1, 2, 3, 4, 5, 6, 9, 3, 7])
    assert cache.match([8, 2, 3], 3) == (2, (4, 5, 6))  # "2 3" -> 4 5 6
    assert cache.match([9, 3], 2) == (2, (7,))  # the text ends after 7: a shorter guess
    assert cache.match([5, 6, 9, 3], 4) == (3, (7,))  # the longer n-gram decides between 3's two followers
    assert cache.match([42, 43], 3) == (0, ())


def test_the_oldest_texts_go_with_every_index_entry_into_them():
    cache = ProposalCache(10, ngrams=(2,))
    cache.add([1, 2, 3, 4, 5, 6])
    cache.add([7, 8, 9, 10])
    assert len(cache) == 2 and cache.tokens == 10
    cache.add([11, 12, 13])  # 13 tokens would not fit: the first text goes
    assert len(cache) == 2 and cache.tokens == 7
    assert cache.match([1, 2], 2) == (0, ())
    assert cache.match([8, 9], 1) == (2, (10,))
    assert all(text_id != 0 for text_id, _ in cache._follower.values())  # nothing points into the evicted text


def test_a_size_of_nothing_is_refused():
    with pytest.raises(ValueError, match="at least 1 token"):
        ProposalCache(0)


def test_lookup_prefers_its_own_text_on_a_tie_and_the_corpus_when_it_matches_longer():
    corpus = ProposalCache(1000, ngrams=(2, 3))
    corpus.add([1, 2, 3, 50, 51])
    lookup = PromptLookupProposer(max_ngram=3, min_ngram=1, corpus=corpus)
    lookup.begin([], None, None)
    assert lookup.propose([2, 3, 60, 61, 9, 2, 3], 2).token_ids == (60, 61)  # own "2 3" (n=2) ties the corpus's
    assert lookup.propose([7, 1, 2, 3], 2).token_ids == (50, 51)  # "1 2 3" only in the corpus
    assert lookup.corpus_rounds == 1


# -- through the engine ------------------------------------------------------------------------------------
def engine(method="lookup", tokens: int | None = 1 << 16):
    draft = tiny_model("llama", 1) if method == "hybrid" else None
    eng = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=draft, method=method)
    if tokens is not None:
        eng.enable_proposal_cache(tokens)
    return eng


def greedy(prompt: str, eng: Engine, n: int = 40):
    return eng.generate(prompt, max_new_tokens=n, ignore_eos=True, num_draft_tokens=4, adaptive=False)


@pytest.mark.parametrize("method", ["lookup", "hybrid"])
def test_a_continuation_seen_in_an_earlier_request_is_proposed_and_the_output_is_unchanged(method):
    warm, cold, alone = engine(method), engine(method, tokens=None), engine("none", tokens=None)
    prompt = TEMPLATE.format(n=1)
    first = greedy(prompt, warm)
    second = greedy(prompt, warm)  # the same request again: its whole output is in the cache
    assert first.token_ids == second.token_ids == greedy(prompt, cold).token_ids == greedy(prompt, alone).token_ids
    assert second.stats.acceptance_rate > greedy(prompt, cold).stats.acceptance_rate
    assert second.stats.accepted >= 30  # nearly every token came from the first request's text
    lookup = warm.proposer.lookup if method == "hybrid" else warm.proposer
    assert lookup.corpus_rounds > 0 and len(warm.proposal_cache) == 2


def test_batched_sequences_share_one_cache_and_each_keeps_its_own_output():
    warm, alone = engine("lookup"), engine("none", tokens=None)
    prompts = [TEMPLATE.format(n=n) for n in range(4)]
    for prompt in prompts[:2]:
        greedy(prompt, warm)
    cfg = GenerationConfig.from_options(max_new_tokens=30, ignore_eos=True, num_draft_tokens=4)
    together = run_together(warm, [(p, cfg) for p in prompts])
    assert [seq.context[len(seq.prompt_ids):] for seq in together] == [greedy(p, alone, 30).token_ids for p in prompts]
    assert len(warm.proposal_cache) == 6


def test_without_the_cache_lookup_keeps_nothing_between_requests():
    eng = engine("lookup", tokens=None)
    greedy(TEMPLATE.format(n=1), eng)
    assert eng.proposal_cache is None and eng.proposer.corpus is None


def test_a_seeded_sampled_request_repeats_whatever_the_cache_holds():
    """Its tokens are its seed's draws (shared_noise.py), whatever the guesses: it takes the cache's too."""
    eng = engine("lookup")
    prompt = TEMPLATE.format(n=2)

    def sampled():
        return eng.generate(prompt, max_new_tokens=30, ignore_eos=True, temperature=1.0, seed=11).token_ids

    first = sampled()
    for n in range(3):
        greedy(TEMPLATE.format(n=n), eng)  # the cache now holds texts that would change its drafts
    assert sampled() == first and eng.proposer.corpus_rounds > 0
