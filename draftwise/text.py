"""Token ids -> streamed text, holding back what might still change or belong to a stop string."""
from __future__ import annotations

class TextStream:
    """Decode incrementally (as vLLM does) and cut the text before the first stop string.

    add() returns the text that is now safe to show: complete characters that cannot become
    the start of a stop string. finish() returns the rest.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # all decoded text so far
        self.shown = 0  # characters of self.text already returned
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] were decoded last time as context
        self._read = 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        self.text += self._decode_new()
        cut = self._stop_index()
        if cut is not None:
            self.stopped = True
            self.text = self.text[:cut]
            return self._show(cut)
        return self._show(len(self.text) - self._held_back())

    def finish(self) -> str:
        return self._show(len(self.text))

    def _decode_new(self) -> str:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(self.ids[self._prefix : self._read])
        after = decode(self.ids[self._prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an incomplete UTF-8 sequence (or nothing visible): wait for the next token
        # The tokens just read become the left context of the next decode.
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

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
