"""Token ids -> streamed text, holding back what might still change or belong to a stop string."""
from __future__ import annotations

MAX_PENDING = 8  # ids decoded together at most before their text is taken as it is (a character is 4 bytes at most)


class TextStream:
    """Decode incrementally (as vLLM does) and cut the text before the first stop string.

    add() returns the text that is now safe to show: complete characters that cannot become
    the start of a stop string. finish() returns the rest.

    context: the prompt's last few ids, decoded ahead of the first generated one and never shown: a SentencePiece
    decoder drops the leading space of a text's first word, which a continuation keeps (" world" after "Hello").
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), context: list[int] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        # Special tokens decode to nothing here (skip_special_tokens): kept out of the window, a run of them (an
        # EOS emitted again and again with ignore_eos) would make every decode longer than the last.
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self.ids: list[int] = [t for t in context if t not in self._special]
        self.text = ""  # all decoded text so far
        self.shown = 0  # characters of self.text already returned
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] were decoded last time as context
        self._read = len(self.ids)

    def add(self, token_id: int) -> str:
        if token_id not in self._special:
            self.ids.append(token_id)
            self.text += self._decode_new()
        return self._cut_or_hold()

    def finish(self) -> str:
        """The rest: what was held back, and the text of ids still waiting on a character that the end cut short
        (shown as the tokenizer decodes it, U+FFFD), so that the text holds every id that was counted."""
        piece = ""
        if not self.stopped and self._read < len(self.ids):
            self.text += self._decode_new(final=True)
            piece = self._cut_or_hold()
        return piece + self._show(len(self.text))

    def _cut_or_hold(self) -> str:
        cut = self._stop_index()
        if cut is not None:
            self.stopped = True
            self.text = self.text[:cut]
            return self._show(cut)
        return self._show(len(self.text) - self._held_back())

    def _decode_new(self, final: bool = False) -> str:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(self.ids[self._prefix : self._read])
        after = decode(self.ids[self._prefix :])
        # More pending ids than any character takes bytes: what they decode to is final, whatever it is.
        waiting = len(self.ids) - self._read < MAX_PENDING and not final
        if waiting and (after.endswith("\ufffd") or len(after) <= len(before)):
            return ""  # an incomplete UTF-8 sequence (or nothing visible): wait for the next token
        # The tokens just read become the left context of the next decode.
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""

    def _stop_index(self) -> int | None:
        # A stop string can only newly appear in text not yet scanned, plus its own length back.
        found = [
            i
            for s in self.stop
            if (i := self.text.find(s, max(0, self.shown - len(s) + 1))) != -1
        ]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is the start of some stop string."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:n]):
                    held = n
                    break
        return held

    def _show(self, end: int) -> str:
        piece = self.text[self.shown : end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return piece
