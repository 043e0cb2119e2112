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
