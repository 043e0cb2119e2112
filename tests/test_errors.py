"""Bad input: each limit is checked before work starts, with a message that says what is allowed."""
from __future__ import annotations

import functools

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from conftest import tiny_model, tiny_tokenizer
from draftwise import DraftwiseError, Engine
from draftwise.config import SamplingConfig
from draftwise.sampling import logits_to_probs
from draftwise.tokenizers import check_same_tokenizer


@functools.lru_cache(maxsize=None)
def engine(method="draft"):
    draft = tiny_model("llama", 1, 1) if method == "draft" else None
    return Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=draft, method=method)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"num_draft_tokens": 0}, "num_draft_tokens (k) must be >= 1, got 0"),
        ({"num_draft_tokens": 65}, "num_draft_tokens (k) must be between 1 and 64, got 65"),
        ({"temperature": -0.5}, "temperature must be a finite number >= 0 (0 means greedy), got -0.5"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0 (0 means greedy), got inf"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"seed": 2**64, "temperature": 1.0}, "seed must be an integer from -9223372036854775808 to"),
    ],
)
def test_bad_options_are_refused_before_any_work(options, message):
    eng = engine()
    before = eng.target.cache_len
    with pytest.raises(DraftwiseError) as err:
        eng.stream("hello", **options)  # raises at the call, not at the first token
    assert message in str(err.value)
    assert eng.target.cache_len == before


def test_a_tiny_temperature_samples_the_argmax_instead_of_failing():
    # Divided unshifted, 1e-40 sent every logit to +-inf and the softmax to NaN, which the sampler refused mid-request.
    probs = logits_to_probs(torch.tensor([[1.0, 3.0, 2.0, -50.0]]), SamplingConfig(temperature=1e-40))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    greedy = engine().generate("the cat", max_new_tokens=8, ignore_eos=True)
    tiny = engine().generate("the cat", max_new_tokens=8, ignore_eos=True, temperature=1e-40, seed=3)
    assert tiny.token_ids == greedy.token_ids


def test_a_sequence_that_fails_to_open_gives_its_slot_back(monkeypatch):
    eng = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), method="lookup")
    slots = eng.target.open_slots

    def refuse(seed):
        raise RuntimeError("no generator")

    monkeypatch.setattr("draftwise.lifecycle.make_generator", refuse)
    for _ in range(2):  # the default slot, then (were it kept) a slot of its own
        with pytest.raises(RuntimeError, match="no generator"):
            eng.generate("hello", max_new_tokens=2)
    monkeypatch.undo()
    assert eng.target.open_slots == slots and eng.generate("hello", max_new_tokens=2).token_ids


def test_prompt_longer_than_the_context():
    long_prompt = "the fox " * 400  # > 512 positions of the tiny model
    with pytest.raises(DraftwiseError, match=r"exceeds the model context of 512 tokens; shorten the prompt"):
        engine().generate(long_prompt, max_new_tokens=8)


def test_prompt_plus_new_tokens_longer_than_the_context_says_how_many_fit():
    prompt = "the fox " * 100
    n = len(tiny_tokenizer()(prompt)["input_ids"])
    with pytest.raises(DraftwiseError, match=f"at most {512 - n} new tokens fit"):
        engine().generate(prompt, max_new_tokens=512)


def test_empty_prompt():
    with pytest.raises(DraftwiseError, match="the prompt is empty"):
        engine().generate("")


def test_unknown_method_and_missing_draft():
    with pytest.raises(DraftwiseError, match="unknown method 'medusa'; choose one of: draft, draft-tree, lookup, lookup-tree, none"):
        Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), method="medusa")
    with pytest.raises(DraftwiseError, match="method 'draft' needs a draft model"):
        Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), method="draft")


def other_tokenizer(corpus):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


def test_a_draft_with_another_tokenizer_drafts_through_text_and_the_pair_check_names_the_difference():
    """No longer refused (proposers/cross_vocab.py); where a path needs the same tokenizer (the llama.cpp backend),
    check_same_tokenizer names the first difference."""
    other = other_tokenizer(["completely different text about zebras and xylophones"] * 10)
    engine = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=tiny_model("llama", 1),
                                draft_tokenizer=other)
    assert engine.speed_paths["draft_tokenizer"] == "cross-tokenizer"
    with pytest.raises(DraftwiseError) as err:
        check_same_tokenizer(tiny_tokenizer(), other)
    message = str(err.value)
    assert "a draft must share the target's tokenizer" in message
    assert "token id 1 is '<|user|>' in the target but '!' in the draft" in message


class RenamedToken:
    """The target's tokenizer with one learned token spelled differently."""

    def __init__(self, target, token_id, spelling):
        self._vocab = {(spelling if i == token_id else t): i for t, i in target.get_vocab().items()}
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            setattr(self, name, getattr(target, name))

    def __len__(self):
        return len(self._vocab)

    def get_vocab(self):
        return self._vocab


def test_first_difference_is_named_exactly():
    target = tiny_tokenizer()
    by_id = {i: t for t, i in target.get_vocab().items()}
    with pytest.raises(DraftwiseError, match=f"token id 270 is {by_id[270]!r} in the target but 'ZZ' in the draft"):
        check_same_tokenizer(target, RenamedToken(target, 270, "ZZ"))
    check_same_tokenizer(target, RenamedToken(target, 270, by_id[270]))  # identical: no error


def test_a_draft_tokenizer_of_another_size_names_the_first_token_it_differs_by():
    target = tiny_tokenizer()
    longer = RenamedToken(target, -1, "")
    longer._vocab["<|tool|>"] = len(target)  # one token more
    with pytest.raises(DraftwiseError, match=rf"token id {len(target)} is absent in the target but '<\|tool\|>' in "
                                             rf"the draft \(of {len(target)} and {len(target) + 1} tokens\)"):
        check_same_tokenizer(target, longer)


def test_a_draft_model_that_cannot_read_every_token_is_refused_before_it_runs():
    # No draft tokenizer to compare: the draft's embedding must still read every id the tokenizer makes.
    short = tiny_model("llama", 1, 1, vocab_size=20)
    with pytest.raises(DraftwiseError, match=rf"the draft model reads 20 token ids but the target and its "
                                             rf"tokenizer use {len(tiny_tokenizer())}"):
        Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=short, method="draft")
    padded = tiny_model("llama", 1, 1, vocab_size=len(tiny_tokenizer()) + 8)  # padding rows past the tokens: fine
    # A tokenizer listing a token past both models' rows: the draft reads what the target reads.
    rows = len(tiny_tokenizer()) - 1
    Engine.from_models(tiny_model("llama", 0, vocab_size=rows), tiny_tokenizer(),
                       draft_model=tiny_model("llama", 1, 1, vocab_size=rows), method="draft")
    engine = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=padded, method="draft")
    assert engine.generate("the cat", max_new_tokens=4, ignore_eos=True).stats.new_tokens == 4


def test_a_write_that_fails_leaves_the_old_file_and_no_half_one_beside_it(tmp_path):
    from draftwise.files import write_whole

    target = tmp_path / "out.json"
    target.write_text("old")

    def half_then_fail(partial):
        partial.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_whole(target, half_then_fail)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    write_whole(target, lambda partial: partial.write_text("new"))
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
