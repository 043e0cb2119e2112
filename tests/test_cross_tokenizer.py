"""Drafts with another tokenizer than the target's (proposers/cross_vocab.py): their guesses reach the target as
text, and the output stays the target's own, greedy bit for bit, sampled in distribution.

Two kinds of draft: a shuffled twin (the target itself over a vocabulary whose ids are shuffled: another tokenizer
that spells texts alike, so its guesses are mostly right, which proves that they are translated, not just
rejected), and a random model over a SentencePiece-style vocabulary (another tokenizer altogether, as Gemma's is to
Qwen's), whose guesses are mostly wrong.
"""
from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
from tokenizers import normalizers

from conftest import (decode_together, piece_tokenizer, shuffled_tokenizer, shuffled_twin, tiny_model,
                      tiny_tokenizer, transformers_greedy)
from draftwise import Engine
from draftwise.cli import stats_line
from draftwise.config import GenerationConfig
from draftwise.errors import DraftwiseError
from draftwise.proposers.cross_vocab import CrossTokenizerProposer, VocabBridge
from draftwise.token_text import TokenTexts, whole_characters
from draftwise.tokenizers import CROSS_TOKENIZER, SHARED_TOKENIZER, draft_path
from stats_helpers import fit_pvalue

PROMPT = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n"
# Characters the tiny tokenizer has no merges for: each is 2 to 4 one-byte tokens, so texts end inside them.
WIDE = "caf\u00e9 \u4e2d\u6587 \U0001f916 fox"
NEW_TOKENS = 40


@functools.lru_cache(maxsize=None)
def target(arch: str = "llama"):
    return tiny_model(arch, 0)


@functools.lru_cache(maxsize=None)
def shuffled():
    return shuffled_tokenizer(tiny_tokenizer())


@functools.lru_cache(maxsize=None)
def draft(kind: str, arch: str = "llama"):
    """(draft model, its tokenizer): twin, the target over shuffled ids; piece, a random model over piece_tokenizer."""
    if kind == "twin":
        tokenizer, order = shuffled()
        return shuffled_twin(target(arch), order), tokenizer
    return tiny_model("llama", 5, 1, tokenizer=piece_tokenizer()), piece_tokenizer()


def engine(method: str, kind: str, arch: str = "llama", dtype=torch.float32, **options):
    model, tokenizer = draft(kind, arch)
    # compact_draft=False: the twin stays the target's exact twin (int8 copies would make it only nearly so)
    return Engine.from_models(target(arch).to(dtype), tiny_tokenizer(), draft_model=model.to(dtype), method=method,
                              draft_tokenizer=tokenizer, compact_draft=False, **options)


@functools.lru_cache(maxsize=None)
def reference(prompt: tuple[int, ...], arch: str = "llama", dtype=torch.float32) -> list[int]:
    """The target's greedy tokens from transformers' generate (float32), or from `none` on our engine (bfloat16:
    our batch-invariant kernels round alike in every call shape, transformers' do not)."""
    if dtype == torch.float32:
        return transformers_greedy(target(arch), list(prompt), NEW_TOKENS)
    eng = Engine.from_models(target(arch).to(dtype), tiny_tokenizer(), method="none")
    return eng.generate(list(prompt), max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids


def ids(text: str) -> tuple[int, ...]:
    return tuple(tiny_tokenizer()(text)["input_ids"])


# -- each token's bytes -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [tiny_tokenizer, lambda: shuffled()[0], piece_tokenizer],
                         ids=["byte-level", "shuffled", "sentencepiece"])
def test_every_tokenizer_spells_texts_back_byte_for_byte(make):
    texts = TokenTexts(make())
    for text in (PROMPT, WIDE, "<|user|>hi<|end|>", "  two  spaces\n\n\ttab"):
        token_ids = texts.encode(text)
        assert texts.bytes_of(token_ids) == text.encode()
    # a text cut inside a character: its tokens' bytes end there too
    wide = texts.encode(WIDE)
    assert any(whole_characters(texts.bytes_of(wide[:n])) < len(texts.bytes_of(wide[:n])) for n in range(len(wide)))


def test_the_start_tokens_a_tokenizer_puts_before_a_text_are_known():
    assert TokenTexts(piece_tokenizer()).start_ids == [piece_tokenizer().bos_token_id]
    assert TokenTexts(tiny_tokenizer()).start_ids == []


def test_a_tokenizer_that_changes_the_text_is_refused_at_load():
    lowercasing = shuffled_tokenizer(tiny_tokenizer())[0]
    lowercasing.backend_tokenizer.normalizer = normalizers.Lowercase()
    with pytest.raises(DraftwiseError, match="does not spell its own tokens back byte for byte"):
        TokenTexts(lowercasing, name="the draft's tokenizer")


@pytest.mark.parametrize("data,whole", [(b"", 0), (b"ab", 2), ("a\u4e2d".encode(), 4), ("a\u4e2d".encode()[:3], 1),
                                        ("\U0001f916".encode()[:3], 0), ("\u00e9".encode()[:1], 0),
                                        (b"\x80\x80", 2)])
def test_whole_characters_stop_before_a_cut_character(data, whole):
    assert whole_characters(data) == whole


# -- the pair check -------------------------------------------------------------------------------------------------
def test_the_pair_check_says_which_path_a_draft_takes():
    assert draft_path(tiny_tokenizer(), tiny_tokenizer()) == SHARED_TOKENIZER
    assert draft_path(tiny_tokenizer(), shuffled()[0]) == CROSS_TOKENIZER
    assert draft_path(tiny_tokenizer(), piece_tokenizer()) == CROSS_TOKENIZER
    cross = engine("draft", "twin")
    assert cross.speed_paths["draft_tokenizer"] == CROSS_TOKENIZER
    line = stats_line(cross.generate(PROMPT, max_new_tokens=4, num_draft_tokens=2).stats)
    assert line.startswith("[draft k=2 float32 cross-tokenizer] 4 tokens")  # the CLI's stats line says so
    assert "cross-tokenizer" not in stats_line(cross.generate(PROMPT, max_new_tokens=4, method="lookup").stats)
    shared = Engine.from_models(target(), tiny_tokenizer(), draft_model=target(), method="draft",
                                draft_tokenizer=tiny_tokenizer())
    assert shared.speed_paths["draft_tokenizer"] == SHARED_TOKENIZER
    assert not isinstance(shared.proposer, CrossTokenizerProposer)


def test_tree_methods_are_refused_for_a_draft_with_another_tokenizer():
    for method in ("draft-tree", "hybrid-tree"):
        with pytest.raises(DraftwiseError, match=f"method '{method}' drafts token trees.*it runs draft or hybrid"):
            engine(method, "twin")
    eng = engine("hybrid", "twin")
    assert "draft" in eng.methods_available and "hybrid" in eng.methods_available
    assert "draft-tree" not in eng.methods_available and "hybrid-tree" not in eng.methods_available
    with pytest.raises(DraftwiseError, match="drafts chains; DraftTreeProposer needs a draft that shares"):
        eng.proposer.fork_on_draft_model(type(Engine.from_models(target(), tiny_tokenizer(), draft_model=target(),
                                                                 method="draft-tree").proposer))


# -- text to tokens ---------------------------------------------------------------------------------------------------
def bridge() -> VocabBridge:
    eos = tiny_tokenizer().eos_token_id
    return VocabBridge.of(tiny_tokenizer(), 0, {eos}, piece_tokenizer(), 0, {piece_tokenizer().eos_token_id})


def test_a_guess_becomes_the_targets_tokens_less_the_last_unless_the_draft_ended_it():
    b = bridge()
    text = " the fox runs"
    full = TokenTexts(tiny_tokenizer()).encode(text)
    draft_end, eos = piece_tokenizer().eos_token_id, tiny_tokenizer().eos_token_id
    assert b.continuation(text.encode()) == full[:-1]  # the last may be part of a longer word
    assert b.continuation(text.encode(), cut_last=False) == full
    assert b.continuation(text.encode(), end=draft_end) == [*full, eos]
    assert b.continuation(b"x") == []  # a guess that re-encodes to no token to offer
    assert b.continuation(b"", end=draft_end) == [eos]


def test_a_drafts_end_of_text_becomes_the_targets_end_spelled_alike():
    """SmolLM2's <|im_end|> is Qwen's <|im_end|>, its <|endoftext|> Qwen's <|endoftext|>: here the shuffled twin's."""
    tokenizer, order = shuffled()
    eos = {0, 2}  # the tiny tokenizer's <|end|> and, standing in for a second end, <|assistant|>
    b = VocabBridge.of(tiny_tokenizer(), 0, eos, tokenizer, 0, {order[0], order[2]})
    assert b.ends == {order[0]: 0, order[2]: 2}
    other = VocabBridge.of(tiny_tokenizer(), 0, eos, piece_tokenizer(), 0, {piece_tokenizer().eos_token_id})
    assert other.ends == {piece_tokenizer().eos_token_id: tiny_tokenizer().eos_token_id}  # none spelled alike


def test_the_rest_of_a_character_the_target_began_becomes_its_one_byte_tokens():
    b = bridge()
    rest = "\u4e2d".encode()[1:] + b" fox is"  # the target emitted the character's first byte
    token_ids = b.continuation(rest)
    assert token_ids[:2] == [b.target.byte_tokens[rest[0]], b.target.byte_tokens[rest[1]]]
    assert b.target.bytes_of(token_ids) == rest[: len(b.target.bytes_of(token_ids))]
    # a guess cut inside a character offers the whole characters before it only
    cut = " fox \u4e2d".encode()[:-1]
    assert b"\xe4" not in b.target.bytes_of(b.continuation(cut, end=piece_tokenizer().eos_token_id))


# -- greedy: the target's own tokens ----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["draft", "hybrid"])
@pytest.mark.parametrize("kind", ["twin", "piece"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_is_the_targets_own(method, kind, k):
    eng = engine(method, kind)
    result = eng.generate(list(ids(PROMPT)), max_new_tokens=NEW_TOKENS, num_draft_tokens=k, ignore_eos=True,
                          adaptive=False)
    assert result.token_ids == reference(ids(PROMPT))
    if kind == "twin" and method == "draft":  # translated, not merely rejected: the twin is mostly right
        assert result.stats.acceptance_rate > 0.6 and result.stats.accepted >= NEW_TOKENS // 3
    if kind == "twin":
        assert result.stats.accepted > 0


@pytest.mark.parametrize("arch", ["qwen2", "mistral-sliding"])
def test_greedy_identity_holds_on_other_architectures(arch):
    result = engine("draft", "twin", arch).generate(list(ids(PROMPT)), max_new_tokens=NEW_TOKENS, num_draft_tokens=4,
                                                   ignore_eos=True, adaptive=False)
    assert result.token_ids == reference(ids(PROMPT), arch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("method,kind", [("draft", "twin"), ("hybrid", "piece"), ("draft", "piece")])
def test_batched_rows_are_each_the_targets_own(dtype, method, kind):
    """Three sequences decoded together (their draft forwards shared), one of them inside wide characters."""
    eng = engine(method, kind, dtype=dtype)
    prompts = [ids(PROMPT), ids(WIDE)[:-3], ids("The quick brown fox")]
    cfg = GenerationConfig.from_options(max_new_tokens=NEW_TOKENS, num_draft_tokens=3, ignore_eos=True)
    seqs = decode_together(eng, [list(p) for p in prompts], cfg)
    for seq, prompt in zip(seqs, prompts):
        assert seq.context[len(prompt):] == reference(prompt, dtype=dtype)


def test_a_text_that_ends_inside_a_character_is_drafted_on_exactly():
    """The prompt stops after a character's first byte: the draft reads to the last whole character, and its guesses
    that spell the character's rest reach the target as one-byte tokens, which it keeps."""
    wide = list(ids(WIDE))
    texts = TokenTexts(tiny_tokenizer())
    cut = next(n for n in range(1, len(wide)) if whole_characters(texts.bytes_of(wide[:n])) < len(texts.bytes_of(wide[:n])))
    prompt = tuple(wide[:cut])
    eng = engine("draft", "twin")
    offered = []
    eng.round_observer = lambda seq, d, verdict, times: offered.append((list(d.token_ids), verdict.num_accepted))
    result = eng.generate(list(prompt), max_new_tokens=NEW_TOKENS, num_draft_tokens=4, ignore_eos=True,
                          adaptive=False)
    assert result.token_ids == reference(prompt)
    assert offered[0][1] > 0  # the first round's guess, made from inside the character, was kept


def test_a_draft_that_ends_its_text_offers_the_targets_end_of_sequence():
    model, tokenizer = draft("twin")
    ending = shuffled_twin(target(), shuffled()[1])
    head = torch.nn.Linear(ending.lm_head.in_features, ending.lm_head.out_features, bias=True)
    with torch.no_grad():  # the twin, sure that every text ends now
        head.weight.copy_(ending.lm_head.weight)
        head.bias.zero_()[tokenizer.eos_token_id] = 1e4
    ending.set_output_embeddings(head)
    eng = Engine.from_models(target(), tiny_tokenizer(), draft_model=ending, method="draft", draft_tokenizer=tokenizer,
                             compact_draft=False)
    offered = []
    eng.round_observer = lambda seq, d, verdict, times: offered.append(tuple(d.token_ids))
    result = eng.generate(list(ids(PROMPT)), max_new_tokens=12, num_draft_tokens=3, ignore_eos=True, adaptive=False)
    assert result.token_ids == reference(ids(PROMPT))[:12]
    assert offered and all(d == (tiny_tokenizer().eos_token_id,) for d in offered)


def test_after_each_round_the_drafts_cache_holds_only_kept_text():
    """Round by round (the twin: many guesses kept): the cache holds the draft's tokens for the text read, then the
    guessed tokens whose text the target kept, and not one token the text does not hold; and the draft is at most
    the round's last token behind (the engine's ROUND_FEED)."""
    eng = engine("draft", "twin")
    cfg = GenerationConfig.from_options(max_new_tokens=40, num_draft_tokens=4, ignore_eos=True, adaptive=False)
    seq = eng.open_sequence(list(ids(PROMPT)), cfg)
    kept_guesses = 0
    try:
        while not seq.prefill_done:
            eng.prefill(seq)
        proposer = seq.proposer
        while seq.finish is None:
            eng.step([seq])
            known = proposer._known
            assert proposer._cached[:len(known)] == known  # nothing of the text read was lost
            assert proposer.bridge.target.bytes_of(seq.context).startswith(
                proposer.bridge.draft.bytes_of(proposer._cached))  # nothing the text does not hold
            assert proposer.backend.cache_len == len(proposer._cached)
            assert proposer.behind(seq.context) <= 1
            kept_guesses += len(proposer._cached) > len(known)
    finally:
        eng.close_sequence(seq)
    assert kept_guesses >= 3  # guessed tokens stayed in the cache, round after round


def test_a_round_that_raises_mid_draft_leaves_the_cache_as_its_list_says():
    eng = engine("draft", "twin")
    cfg = GenerationConfig.from_options(max_new_tokens=30, num_draft_tokens=4, ignore_eos=True, adaptive=False)
    seq = eng.open_sequence(list(ids(PROMPT)), cfg)
    try:
        while not seq.prefill_done:
            eng.prefill(seq)
        eng.step([seq])
        proposer, calls = seq.proposer, []
        real_forward = proposer.backend.forward

        def second_forward_fails(token_ids):
            calls.append(token_ids)
            if len(calls) == 2:
                raise RuntimeError("the draft failed")
            return real_forward(token_ids)

        proposer.backend.forward = second_forward_fails
        eng.step([seq])
        assert seq.finish == "error" and len(calls) == 2  # the round ended in its second draft forward
        assert proposer.backend.cache_len == len(proposer._cached)
        assert proposer.bridge.target.bytes_of(seq.context).startswith(
            proposer.bridge.draft.bytes_of(proposer._cached))
        proposer.backend.forward = real_forward
    finally:
        eng.close_sequence(seq)
    result = eng.generate(list(ids(PROMPT)), max_new_tokens=30, num_draft_tokens=4, ignore_eos=True, adaptive=False)
    assert result.token_ids == reference(ids(PROMPT))[:30]  # the same proposer drafts the next sequence exactly


def test_a_draft_caught_up_in_chunks_after_lookup_rounds_drafts_on_exactly():
    """A hybrid whose lookup wins rounds leaves its draft behind; the engine catches it up in chunks (extend)."""
    eng = engine("hybrid", "twin")
    loop = list(ids("the fox runs. " * 6))
    result = eng.generate(loop, max_new_tokens=NEW_TOKENS, num_draft_tokens=8, ignore_eos=True)
    assert result.token_ids == reference(tuple(loop))
    proposer = eng.proposer.draft
    extended = []
    real_extend = proposer.extend
    proposer.extend = lambda token_ids: (extended.append(len(token_ids)), real_extend(token_ids))
    seq = eng.open_sequence(loop, GenerationConfig.from_options(max_new_tokens=NEW_TOKENS, num_draft_tokens=8,
                                                                ignore_eos=True, adaptive=False))
    try:
        while not seq.prefill_done:
            eng.prefill(seq, 5)  # the prompt in chunks of 5: the draft's too
        while seq.finish is None:
            eng.step([seq])
        assert seq.context[len(loop):] == reference(tuple(loop))
    finally:
        eng.close_sequence(seq)
    assert len(extended) >= 2 and max(extended) <= 5


@pytest.mark.parametrize("text", ["cafe\u0301 au lait", "a \u2581 b \u2581\u2581 c"], ids=["decomposed", "metaspace"])
def test_a_text_its_tokens_do_not_spell_alike_is_read_in_windows_still(text):
    """A normalizer changes these texts (NFC, or '\u2581' read as a space): token ends come from the tokenizer's
    offsets, so the next round re-encodes a window, not the whole text."""
    texts = TokenTexts(piece_tokenizer())
    data = text.encode()
    token_ids, ends = texts.encode_spans(data)
    assert len(ends) == len(token_ids) and ends == sorted(ends) and ends[-1] == len(data)
    prompt = ids(text + " the fox")
    result = engine("draft", "piece").generate(list(prompt), max_new_tokens=12, num_draft_tokens=4, ignore_eos=True,
                                               adaptive=False)
    assert result.token_ids == reference(prompt)[:12]


# -- sampled: the target's distribution ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def sampled_pairs(method: str, setting: str, k: int, prompt_name: str, seeded: bool = True) -> tuple[list, int, int]:
    """The first two tokens of RUNS generations of test_sampling_e2e's target, drafted by a shuffled twin of the
    target at another temperature (right often, not always); and the guesses kept and not kept over them. Seeded:
    drawn from shared noise; else by rejection sampling, each run's generator seeded here so that the test repeats."""
    from test_sampling_e2e import RUNS, run_batched

    pairs, (kept, not_kept), _ = run_batched(method if seeded else f"{method}-rejection", setting, k, prompt_name,
                                             range(RUNS), cross_engine(method))
    return pairs, kept, not_kept


def cross_engine(method: str) -> Engine:
    from test_sampling_e2e import sharpened, target as sampled_target

    tokenizer, order = shuffled()
    return Engine.from_models(sampled_target(), tiny_tokenizer(), draft_model=shuffled_twin(sharpened(1.5), order),
                              method=method, draft_tokenizer=tokenizer)


@pytest.mark.parametrize("seeded", [True, False], ids=["shared-noise", "rejection"])
def test_batched_runs_give_the_pairs_of_runs_alone(seeded):
    """What lets the runs below go batched: each row's tokens and counts are those of its generate() alone."""
    from test_sampling_e2e import BATCH, run_alone, run_batched

    method = "draft" if seeded else "draft-rejection"
    seeds = range(BATCH + 10)
    alone = run_alone(method, "t1", 2, "loop", seeds, cross_engine("draft"))
    assert run_batched(method, "t1", 2, "loop", seeds, cross_engine("draft")) == alone
    assert alone[1][0] > 0 and alone[1][1] > 0


@pytest.mark.parametrize("seeded", [True, False], ids=["shared-noise", "rejection"])
def test_first_two_tokens_follow_the_target(seeded):
    """The draft's chain at k=2 (the hybrid verifies its draft part's guesses by the same one-hot rule)."""
    from test_sampling_e2e import RUNS, SETTINGS, exact_pairs

    method, setting, k, prompt_name = "draft", "t1", 2, "loop"
    pairs, kept, not_kept = sampled_pairs(method, setting, k, prompt_name, seeded)
    assert fit_pvalue(pairs, exact_pairs(SETTINGS[setting], prompt_name)) > 1e-3
    assert kept >= RUNS // 8 and not_kept >= RUNS // 10  # both paths of the one-hot rule, many times
    # power: the same samples are far from another setting's distribution
    assert fit_pvalue(pairs, exact_pairs(SETTINGS["t0.7-topk-topp"], prompt_name)) < 1e-6


def test_a_wrong_recovery_rule_fails_the_same_check():
    """The control: after a rejected guess, drawing from p itself rather than p without the guess must be caught."""
    from test_sampling_e2e import SETTINGS, exact_pairs

    with mock.patch("draftwise.verify.batch._residual", lambda p_i, q, i, token: p_i):
        pairs, _, _ = sampled_pairs.__wrapped__("draft", "t1", 2, "loop", seeded=False)
    assert fit_pvalue(pairs, exact_pairs(SETTINGS["t1"], "loop")) < 1e-3


# -- served ------------------------------------------------------------------------------------------------------------
def test_served_at_concurrency_4_each_text_is_the_same_as_alone():
    """The official openai client against the server on 127.0.0.1, hybrid with a draft of another tokenizer: 8
    requests 4 at a time (their draft forwards shared), each the text it gets alone; a tree method is a 400."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from draftwise.serve.app import create_app
    from draftwise.serve.command import serve_in_thread
    from draftwise.serve.metrics import ServeMetrics
    from draftwise.serve.scheduler import Scheduler

    prompts = [PROMPT, WIDE, "The quick brown fox", "for i in range(10):", "Summaries copy spans of",
               "print(i * i)", "The dog sleeps; the fox", "the article says that"]
    eng, metrics, batches = engine("hybrid", "piece"), ServeMetrics(), []
    real_observe = metrics.observe_step
    metrics.observe_step = lambda size, *a: (batches.append(size), real_observe(size, *a))
    scheduler = Scheduler(eng, max_batch=4, max_waiting=16, prefill_chunk=8, metrics=metrics)
    scheduler.start()
    url, stop = serve_in_thread(create_app(scheduler, "tiny", metrics, None))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)

        def complete(prompt, **extra):
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, **extra)

        with ThreadPoolExecutor(4) as pool:
            served = list(pool.map(lambda p: complete(p).choices[0].text, prompts))
        with pytest.raises(openai.BadRequestError, match="speculation.method"):
            complete(PROMPT, extra_body={"speculation": {"method": "draft-tree"}})
    finally:
        stop()
        scheduler.drain(5)
    alone = engine("hybrid", "piece")
    assert served == [alone.generate(p, max_new_tokens=24).text for p in prompts]
    assert max(batches) > 1  # they really shared steps
