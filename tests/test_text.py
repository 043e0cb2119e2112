"""Streamed text: pieces add up to the decoded text, and nothing at or after a stop string is shown."""
from __future__ import annotations

import pytest

from conftest import tiny_tokenizer
from draftwise.text import TextStream

REPLACEMENT = "\ufffd"  # U+FFFD, what a decoder shows for an incomplete UTF-8 sequence
TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ and 日本語 too."


def stream(text, stop=()):
    tokenizer = tiny_tokenizer()
    ts = TextStream(tokenizer, tuple(stop))
    pieces = []
    for token in tokenizer(text)["input_ids"]:
        pieces.append(ts.add(token))
        if ts.stopped:
            break
    pieces.append(ts.finish())
    return pieces, ts


def test_text_splits_multi_byte_characters_across_tokens():
    # Otherwise the check below would have nothing to catch: some token must decode alone to half a character.
    tokenizer = tiny_tokenizer()
    alone = [tokenizer.decode([token]) for token in tokenizer(TEXT)["input_ids"]]
    assert any(REPLACEMENT in piece for piece in alone)


def test_pieces_add_up_to_the_decoded_text():
    pieces, _ = stream(TEXT)
    assert all(REPLACEMENT not in piece for piece in pieces)  # multi-byte characters never shown half-done
    assert "".join(pieces) == TEXT


@pytest.mark.parametrize("stop", ["fox", "dog.", "日本", "✓"])
def test_text_stops_before_the_stop_string(stop):
    pieces, ts = stream(TEXT, [stop])
    assert ts.stopped
    assert "".join(pieces) == TEXT[: TEXT.index(stop)]


def test_earliest_of_several_stop_strings_wins():
    pieces, _ = stream(TEXT, ["lazy", "brown"])
    assert "".join(pieces) == "The quick "


def test_a_possible_stop_prefix_is_held_back_until_it_is_resolved():
    tokenizer = tiny_tokenizer()
    ts = TextStream(tokenizer, ("brown cat",))
    shown = ""
    for token in tokenizer("The quick brown fox")["input_ids"]:
        shown += ts.add(token)
        assert "brown" not in shown or "brown f" in shown + ts.text[len(shown):]  # held while it may still stop
        if ts.text.endswith("brown"):
            assert not shown.endswith("brown")
    assert not ts.stopped
    assert shown + ts.finish() == "The quick brown fox"


def test_a_character_cut_short_by_the_end_is_shown_as_the_tokenizer_decodes_it():
    # max_new_tokens may end the text mid-character: the ids were counted, so their text is shown (U+FFFD), as
    # decoding them all at once shows it, instead of being dropped.
    tokenizer = tiny_tokenizer()
    ids = tokenizer("ok 日本語")["input_ids"]
    for end in range(1, len(ids) + 1):
        ts = TextStream(tokenizer)
        shown = "".join(ts.add(token) for token in ids[:end]) + ts.finish()
        assert shown == tokenizer.decode(ids[:end], skip_special_tokens=True)


def test_special_tokens_stay_out_of_the_decode_window():
    # With ignore_eos a model may emit its EOS again and again: each would lengthen every later decode.
    tokenizer = tiny_tokenizer()
    ts = TextStream(tokenizer)
    ids = tokenizer("The quick")["input_ids"]
    shown = "".join(ts.add(token) for token in [*ids, *[tokenizer.eos_token_id] * 500, *ids])
    assert len(ts.ids) == 2 * len(ids) and shown + ts.finish() == "The quickThe quick"


def test_the_prompts_last_ids_give_a_continuation_its_leading_space():
    # A SentencePiece decoder strips the first word's leading space: decoded alone, the continuation of "Hello"
    # would read "world!", and a client joining prompt and text would get "Helloworld!".
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<unk>": 1, "▁Hello": 2, "▁world": 3, "!": 4}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", unk_token="<unk>")
    assert tokenizer.decode([3, 4]) == "world!"
    ts = TextStream(tokenizer, context=[0, 2])
    assert ts.add(3) + ts.add(4) + ts.finish() == " world!"
