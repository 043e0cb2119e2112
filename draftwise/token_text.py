"""Each token's text as bytes, and a text's tokens, for the tokenizers the models here come with: a byte-level BPE
(GPT-2's, Qwen's, SmolLM's: every byte spelled as one printable character) or a SentencePiece-style vocabulary
without a space put before every text (Gemma's: '▁' for a space, `<0xNN>` pieces for bytes it has no token for).
Llama 2's kind, which puts one before every text, fails the spelling check at load: a text read in pieces would
gain a space at every piece.

Bytes, not strings, because a token may hold part of a character (a byte-level model spells a Chinese character
in two or three tokens), and a draft with another tokenizer must read the target's text exactly where it stands.
"""
from __future__ import annotations

import functools
import json
import re
from itertools import accumulate

from draftwise.errors import DraftwiseError

# A text every tokenizer here must spell back byte for byte (code, accents, CJK, a symbol): the check at load that
# the table below reads this tokenizer right, before any guess depends on it.
SPELLING_CHECK = "def f(x):\n    return X  # Caf\u00e9, na\u00efve \u4e2d\u6587 \u2713\n\n\tDone."
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
METASPACE = "\u2581"


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable character for each byte, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's tokens spell bytes as characters (a ByteLevel pre-tokenizer or decoder)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise DraftwiseError(f"{type(tokenizer).__name__} is not a fast (Rust) tokenizer; a draft with another "
                             "tokenizer needs one on both sides")
    spec = json.loads(backend.to_str())
    return "ByteLevel" in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])


def token_bytes(tokenizer, rows: int = 0) -> list[bytes]:
    """The text of each id as bytes ([max(rows, len(tokenizer))] entries; ids the tokenizer lacks: b"")."""
    table = [b""] * max(rows, len(tokenizer))
    added = {i: token.content for i, token in tokenizer.added_tokens_decoder.items()}
    alphabet = _byte_level_alphabet() if _is_byte_level(tokenizer) else None
    for piece, i in tokenizer.get_vocab().items():
        if i >= len(table):
            continue
        if i in added:  # special and added tokens: their text as written
            table[i] = added[i].encode()
        elif alphabet is not None:
            table[i] = bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else piece.encode()
        elif match := _BYTE_PIECE.fullmatch(piece):
            table[i] = bytes([int(match.group(1), 16)])
        else:
            table[i] = piece.replace(METASPACE, " ").encode()
    return table


def whole_characters(data: bytes | bytearray) -> int:
    """The length of data's longest prefix that does not end inside a UTF-8 character."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # ASCII or the lead byte of a character: how long is that character?
            length = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else \
                4 if byte >> 3 == 0b11110 else 1
            return len(data) - back if length > back else len(data)
    return len(data)  # continuation bytes alone: no character to wait for


class TokenTexts:
    """One tokenizer's view of text as bytes: each token's bytes, the tokens a text encodes to, and the tokens the
    tokenizer puts before a text of its own (a BOS)."""

    def __init__(self, tokenizer, rows: int = 0, name: str = "the tokenizer"):
        """rows: the model's logit rows (ids past the tokenizer's are padding, text b""); name: for errors."""
        self.tokenizer = tokenizer
        self.size = len(tokenizer)  # ids from here on (to `rows`) are padding rows: never a guess
        self.table = token_bytes(tokenizer, rows)
        # The one-byte tokens (a byte-level BPE has all 256; SentencePiece its <0xNN> pieces): for bytes that are no
        # character, which a model may emit, and for the rest of a character a model began.
        self.byte_tokens = {text[0]: i for i, text in enumerate(self.table)
                            if len(text) == 1 and i not in tokenizer.added_tokens_decoder}
        plain = self.encode("a")
        marked = tokenizer.encode("a", add_special_tokens=True)
        self.start_ids = marked[: len(marked) - len(plain)] if marked[len(marked) - len(plain):] == plain else []
        spelled = self.bytes_of(self.encode(SPELLING_CHECK))
        if spelled != SPELLING_CHECK.encode():
            raise DraftwiseError(f"{name} does not spell its own tokens back byte for byte ({SPELLING_CHECK!r} came "
                                 f"back as {spelled!r}); a draft with another tokenizer needs a byte-level BPE or a "
                                 "SentencePiece vocabulary on both sides")

    def encode(self, text: str) -> list[int]:
        """The tokens of text, special tokens spelled in it read as the tokens, nothing added around it."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_spans(self, data: bytes) -> tuple[list[int], list[int]]:
        """(the tokens of data, where in data each one's text ends): by their bytes where they spell data exactly,
        else (a normalizer changed the text: NFC, a literal '▁') by the tokenizer's offsets, so that a token's end
        is still a place in data."""
        token_ids = self.encode_bytes(data)
        ends = list(accumulate(len(self.table[t]) for t in token_ids))
        if (ends[-1] if ends else 0) == len(data):
            return token_ids, ends
        text = data.decode("utf-8", "replace")
        spans = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        places = [0, *accumulate(len(c.encode("utf-8", "replace")) for c in text)]  # character -> byte offset
        return spans["input_ids"], [places[end] for _, end in spans["offset_mapping"]]

    def encode_bytes(self, data: bytes | bytearray) -> list[int]:
        """The tokens of data: its characters encoded, bytes that are no character as one-byte tokens (U+FFFD where
        the tokenizer has none)."""
        token_ids, start = [], 0
        while start < len(data):
            try:
                return token_ids + self.encode(bytes(data[start:]).decode("utf-8"))
            except UnicodeDecodeError as err:
                bad = start + err.start
                token_ids += self.encode(bytes(data[start:bad]).decode("utf-8"))
                for byte in data[bad: start + err.end]:
                    token_ids += [self.byte_tokens[byte]] if byte in self.byte_tokens else self.encode("\ufffd")
                start += err.end
        return token_ids

    def bytes_of(self, ids) -> bytes:
        table = self.table
        return b"".join(table[i] for i in ids)
