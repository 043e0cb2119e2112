"""A draft model with a tokenizer of its own (SmolLM2's or Gemma's for a Qwen target): it drafts in its own
vocabulary, and its guess reaches the target as text.

Each round the draft reads the target's text in its own tokens, guesses a continuation, and the guess's text,
encoded with the target's tokenizer, is the draft the target verifies. Nothing assumes that a text's tokens are a
prefix of a longer text's tokens, in either vocabulary:
- the target's text grows by its own tokens; the draft's tokens for it are kept to WINDOW tokens before their
  end, and those last ones re-encoded with what is new, since a merge across the old end (" foo" + "bar" ->
  " foobar") changes them; the draft's cache keeps the longest prefix it shares with the new tokens;
- a text that ends inside a character (a byte-level target emitted part of a character's bytes) is read to its
  last whole character; the guess must spell the rest, which reaches the target as its single-byte tokens;
- a guess cut after some draft tokens may stop inside a word that the target spells as one token: its last target
  token is offered all the same (CUT_LAST), since a wrong one costs a row of the verification and a right one
  saves a draft forward (measured: docs/experiments/cross-tokenizer-zen4); a draft that ends its text offers the
  target's end of sequence spelled alike (SmolLM2's <|im_end|>: Qwen's);
- the draft's own start tokens (Gemma's <bos>) head its text as its tokenizer puts them; the target's special
  tokens reach it as their text, which its tokenizer reads as its own special token where it has one (ChatML's
  <|im_start|>, in SmolLM2's and Qwen's vocabularies alike).

Exact in both modes by the rule prompt lookup's guesses are verified by: the guess is a deterministic function of
the text (the draft's greedy choice in its own vocabulary), so under sampling it is a one-hot proposal (Draft.q
None), kept with the target's probability, and a rejection samples the target's distribution without it. The
draft's probabilities never reach the verifier: they are over another vocabulary.

After a round, observe() cuts the draft's cache to the draft tokens whose text the target kept. The prompt cache
holds no entries for such a draft (its keys are the target's tokens): each sequence prefills its draft.
"""
from __future__ import annotations

import torch

from draftwise.backends.base import Backend
from draftwise.errors import DraftwiseError
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.token_text import TokenTexts, whole_characters
from draftwise.types import Draft

# The draft's last tokens for the text that a merge with the text after them may change.
WINDOW = 3
# Whether a guess the draft did not end leaves out its last target token, which may be part of a longer one: no,
# offering it paid with each of the three drafts measured (docs/experiments/cross-tokenizer-zen4, cut_last.py).
CUT_LAST = False
# Draft forwards a round may run per target token it is asked for (the two vocabularies' tokens differ in length).
DRAFT_STEPS_PER_TOKEN = 2


class VocabBridge:
    """The two tokenizers of a cross-tokenizer pair, as text, shared by every sequence of the pair."""

    def __init__(self, target: TokenTexts, draft: TokenTexts, ends: dict[int, int]):
        """ends: each id that ends the draft's text -> the target's id that a guess the draft ended gets."""
        self.target, self.draft, self.ends = target, draft, ends

    @classmethod
    def of(cls, tokenizer, target_rows: int, eos, draft_tokenizer, draft_rows: int, draft_eos) -> VocabBridge:
        """The bridge of a pair, each tokenizer's bytes checked (rows: each model's logit rows). A draft's end of
        text becomes the target's end of sequence spelled alike (SmolLM2's <|im_end|>: Qwen's), else the target
        tokenizer's own (else the least of the target's eos ids)."""
        target, draft = (TokenTexts(tokenizer, target_rows, "the target's tokenizer"),
                         TokenTexts(draft_tokenizer, draft_rows, "the draft's tokenizer"))
        default = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(eos)
        spelled = {target.table[i]: i for i in sorted(eos, reverse=True)}
        return cls(target, draft, {i: spelled.get(draft.table[i], default) for i in draft_eos})

    def continuation(self, text: bytes, end: int | None = None, cut_last: bool = True) -> list[int]:
        """The target's tokens for text that continues the target's own; end: the draft's id that ended its text
        there (None: it did not); cut_last: leave out the last token of a text the draft did not end (it may be
        part of a longer one)."""
        whole = whole_characters(text)  # (bytes that are no character, such as the rest of one the target began,
        ids = self.target.encode_bytes(text[:whole])  # become one-byte tokens)
        if end is not None:
            return [*ids, self.ends[end]]
        return ids[:-1] if cut_last else ids


def on_cross_draft(proposer_cls: type, backend: Backend, bridge: VocabBridge,
                   token_ids: torch.Tensor | None = None) -> CrossTokenizerProposer:
    """What a method asking for a draft-model proposer of proposer_cls gets from a cross-tokenizer draft: the chain
    (DraftModelProposer's stand-in); a tree proposer is refused, naming why."""
    if not issubclass(DraftModelProposer, proposer_cls):
        raise DraftwiseError(f"a draft with another tokenizer than the target's drafts chains; "
                             f"{proposer_cls.__name__} needs a draft that shares the target's tokenizer")
    return CrossTokenizerProposer(backend, bridge, token_ids)


class CrossTokenizerProposer(DraftModelProposer):
    """A draft-model proposer whose draft reads and writes text through a VocabBridge (see the module's text)."""

    capabilities = DraftModelProposer.capabilities  # (a chain in steps, with its own cache of the text)

    def __init__(self, backend: Backend, bridge: VocabBridge, token_ids: torch.Tensor | None = None):
        """token_ids: the draft id of each of its logits (a compact output layer), None: all of its vocabulary."""
        super().__init__(backend, target_vocab_size=len(bridge.target.table), token_ids=token_ids)
        self.bridge = bridge
        self._reset_text()

    def _reset_text(self) -> None:
        self._text = bytearray()  # the target's text so far (prompt and emitted, its start tokens aside), as bytes
        self._read: list[int] = []  # the target tokens read into _text
        self._known = list(self.bridge.draft.start_ids)  # the draft's tokens for _text's whole characters
        self._ends = [0] * len(self._known)  # where in _text each known token's text ends
        # The cache's first min(_aligned, its length) tokens are _known's: _align compares only past them.
        self._aligned = 0
        self._tail = b""  # _text past its last whole character
        self._guess: list[int] = []  # this round's draft tokens
        self._proposal: list[int] = []  # this round's target tokens
        self._k = 0

    # -- the sequence --------------------------------------------------------------------------------------------
    def begin(self, prompt_ids, sampling, generator) -> None:
        super().begin(prompt_ids, sampling, generator)
        self._reset_text()

    def follow_grammar(self, guide) -> None:
        """A grammar's masks are over the target's tokens: the engine cuts a guess where it breaks the grammar."""

    def fork(self) -> CrossTokenizerProposer:
        return self.fork_on_draft_model(DraftModelProposer)

    def fork_on_draft_model(self, proposer_cls: type) -> CrossTokenizerProposer:
        return on_cross_draft(proposer_cls, self._model().open_slot(), self.bridge, self.token_ids)

    def attach_prompt_cache(self, cache) -> None:
        """The prompt cache is keyed by the target's tokens: this draft keeps no entries in it."""

    def restore(self, token_ids: list[int]) -> int:
        return 0

    def remember(self, text: list[int]) -> None:
        pass

    # -- the text ---------------------------------------------------------------------------------------------------
    def behind(self, context: list[int]) -> int:
        return max(0, len(context) - 1 - len(self._read))

    def extend(self, token_ids: list[int]) -> None:
        """Prefill: read the target's tokens, and feed the draft its tokens for them but the last WINDOW."""
        self._read_text(token_ids)
        self._sync()
        keep = self._align()
        feed = self._known[keep: len(self._known) - WINDOW]
        if feed:
            self.backend.append(feed)
            self._cached += feed
            self._aligned = len(self._cached)

    def _read_text(self, token_ids: list[int]) -> None:
        if not self._read:  # the target's own start tokens (a <bos>) are no text: the draft has its own
            starts = self.bridge.target.start_ids
            token_ids, skipped = (token_ids[len(starts):], starts) if token_ids[:len(starts)] == starts else \
                (token_ids, [])
            self._read += skipped
        text = self.bridge.target.bytes_of(token_ids)
        self._read += token_ids
        self._text += text

    def _catch_up(self, context: list[int]) -> None:
        """Read what context holds past the text read so far (all of it anew, should it not continue that text)."""
        read = len(self._read)
        if len(context) < read or (read and context[read - 1] != self._read[-1]):
            self._reset_text()
            read = 0
        self._read_text(context[read:])

    def _sync(self) -> None:
        """The draft's tokens for the text's whole characters: the known ones kept to WINDOW before their end, the
        rest encoded anew."""
        whole = whole_characters(self._text)
        keep = max(len(self.bridge.draft.start_ids), len(self._known) - WINDOW)
        offset = self._ends[keep - 1] if keep else 0
        new, ends = self.bridge.draft.encode_spans(bytes(self._text[offset:whole]))
        del self._known[keep:], self._ends[keep:]
        self._known += new
        self._ends += [offset + end for end in ends]
        self._aligned = min(self._aligned, keep)
        self._tail = bytes(self._text[whole:])

    def _align(self) -> int:
        """Cut the draft's cache to the longest prefix it shares with the known tokens; returns its length."""
        keep = min(self._aligned, len(self._cached), len(self._known))
        for cached, known in zip(self._cached[keep:], self._known[keep:]):
            if cached != known:
                break
            keep += 1
        self._cut(keep)
        self._aligned = keep
        return keep

    def _cut(self, length: int) -> None:
        """Keep the cache's first `length` tokens (at most)."""
        if length < len(self._cached):
            del self._cached[length:]
            self.backend.trim(length)
            self._aligned = min(self._aligned, length)

    # -- a round in steps ----------------------------------------------------------------------------------------
    def start(self, context: list[int], k: int, stop_confidence: float = 0.0) -> None:
        self._catch_up(context)
        self._sync()
        keep = self._align()
        if keep and keep == len(self._known):  # a forward needs a token to feed: the last known one again
            keep -= 1
            self._cut(keep)
        self._k = k
        self._left, self._stop_confidence = DRAFT_STEPS_PER_TOKEN * k + 1, stop_confidence
        self._guess, self._proposal = [], []
        self._feed = self._known[keep:] if k > 0 and self._known else None
        self._aligned = len(self._known)  # (the cache's first tokens, once fed, are these; _cut lowers it)

    def take(self, logits: torch.Tensor) -> None:
        """logits: [draft_vocab] (a compact layer's rows), the draft's row after the fed tokens."""
        self._cached += self._feed
        self._feed = None
        row = logits if self.token_ids is not None else logits[: self.bridge.draft.size]
        best = int(row.argmax())
        token = best if self.token_ids is None else int(self.token_ids[best])
        if token in self.bridge.ends:
            self._proposal = self._translate(end=token)
            return
        self._guess.append(token)
        self._left -= 1
        self._proposal = self._translate()
        confident = self._stop_confidence <= 0 or float(torch.softmax(row.float(), -1)[best]) >= self._stop_confidence
        if len(self._proposal) < self._k and self._left > 0 and confident and self._on_text():
            self._feed = [token]

    def _on_text(self) -> bool:
        """Whether the guess still spells the text's unfinished character (if any) as the target began it."""
        guessed = self.bridge.draft.bytes_of(self._guess[: len(self._tail)])
        return guessed[: len(self._tail)] == self._tail[: len(guessed)]

    def _translate(self, end: int | None = None) -> list[int]:
        """The target's tokens for the guess so far (at most the round's k); end: the draft's id that ended it."""
        guessed, tail = self.bridge.draft.bytes_of(self._guess), self._tail
        if not guessed.startswith(tail):
            return []
        return self.bridge.continuation(guessed[len(tail):], end, CUT_LAST)[: self._k]

    def finish(self) -> Draft:
        return Draft(token_ids=tuple(self._proposal), q=None)

    def observe(self, num_accepted: int) -> None:
        """Cut the cache to the known tokens and the guessed ones whose text the target kept; the kept tokens are
        the text's (the next round reads only what the target added after them)."""
        kept_ids = self._proposal[:num_accepted]
        kept = self._tail + self.bridge.target.bytes_of(kept_ids)
        guessed = self.bridge.draft.bytes_of(self._guess)
        cut, end = len(self._known), 0
        for token in self._cached[len(self._known):]:
            end += len(self.bridge.draft.table[token])
            if end > len(kept) or guessed[:end] != kept[:end]:
                break
            cut += 1
        self._cut(cut)
        self._read_text(kept_ids)
