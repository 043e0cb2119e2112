"""Constrained decoding: a request's output held to a grammar (a JSON schema, any JSON object, a Lark grammar),
with speculation kept exact.

The grammar engine is llguidance (what llama.cpp uses): a matcher per sequence that says which tokens may come
next (a bitmask over the vocabulary, about 15 us for Qwen's 151,936 ids here), consumes tokens, rolls back, and
names the tokens the grammar forces. Three things make speculation under a grammar exact and cheap:

- **The mask is on p.** At every position the target scores (a chain's every draft token and the one after, a
  tree's every node), the logits of tokens the grammar forbids there become -inf before the verifier reads them.
  Greedy then keeps exactly what the target alone picks under the same grammar; sampling draws from the masked,
  renormalized p, so the output follows the constrained distribution whatever the proposer guessed.
- **A draft model drafts under the grammar** (DraftGuide, Proposer.follow_grammar): its own logits are masked at
  each draft position, so its guesses keep to the grammar (a sampled draft's q is then the masked distribution it
  drew from, which is what the verifier needs).
- **A forbidden guess is cut before the target scores it** (Constraint.shape): lookup's, a tree's, a head's. A chain ends at its first forbidden token (greedy or
  a one-hot guess: that token would be rejected for certain and the residual is the masked p itself). A sampled
  draft with its own q keeps that one token, so that the verifier draws from norm(max(0, p - q)) as the proof
  needs, and loses the rest, which could not be reached. Trees are masked, not cut: a forbidden node is never kept.
- **Forced tokens are free.** Where the grammar allows one continuation only (a schema's keys, braces, quotes, a
  tool call's frame), its text is known without any model, and llguidance's tokens for it follow the proposer's
  kept guesses in the round's draft (SGLang's jump-forward; a round the proposer sits out drafts them alone). They are verified like any guess, not committed: the mask also allows other
  tokenizations of the same text (`{` then `"` where the forced draft says `{"`), and the target alone might pick
  one of those, so committing the forced tokens unverified would change its tokens, if not its text.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import torch

from draftwise.errors import DraftwiseError
from draftwise.types import Draft, follow

JSON_OBJECT_SCHEMA = {"type": "object"}  # OpenAI's json_object mode: any JSON object
# JSON on one line, as Python's json.dumps writes it ({"a": 1, "b": [2, 3]}) and Qwen's template writes tool calls:
# every key, quote and separator is then a token the grammar forces, drafted for free, and no model can write
# whitespace until its token limit (llguidance's default lets any whitespace in between tokens). On the Qwen pair it
# also writes fewer tokens than indented JSON (docs/experiments/structured-zen4). A schema's own "x-guidance" wins.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_REMEMBERED_GRAMMARS = 256  # (the set of checked grammars starts over past this many)
_BITS = torch.arange(32, dtype=torch.int32)  # [32]: a mask word's bits, lowest first (llguidance's order)


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as err:  # (a dependency; only a broken install lacks it)
        raise DraftwiseError("structured output needs llguidance: pip install llguidance") from err
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a sequence's output must match, as llguidance's grammar text. Build one with json_schema, json_object
    or lark. jump_forward: a speculating sequence drafts the tokens the grammar forces, for free (a sequence
    that does not speculate, `none`, steps one token at a time: the target alone)."""

    source: str
    kind: str  # what it was made from ("json_schema", "json_object", "lark"): named in errors
    jump_forward: bool = True

    @classmethod
    def json_schema(cls, schema: dict | str, jump_forward: bool = True) -> "Grammar":
        """Output that is one JSON value valid under the schema (a dict or its JSON text)."""
        llg = _llguidance()
        try:
            source = llg.LLMatcher.grammar_from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                                            defaults=JSON_STYLE)
        except ValueError as err:
            raise DraftwiseError(f"the JSON schema is not a JSON object: {err}") from err
        return cls(source, "json_schema", jump_forward)

    @classmethod
    def json_object(cls, jump_forward: bool = True) -> "Grammar":
        """Output that is any one JSON object."""
        return cls(cls.json_schema(JSON_OBJECT_SCHEMA).source, "json_object", jump_forward)

    @classmethod
    def lark(cls, text: str, jump_forward: bool = True) -> "Grammar":
        """Output in the language of a Lark grammar (llguidance's dialect: `%json {schema}` embeds a schema)."""
        return cls(_llguidance().LLMatcher.grammar_from_lark(text), "lark", jump_forward)

    def with_jump_forward(self, on: bool) -> "Grammar":
        return Grammar(self.source, self.kind, on)


class GrammarCompiler:
    """One engine's llguidance view of its tokenizer (built on first use: about a second) and the matchers made on
    it. vocab: the width of the target's logits (Qwen's pads past the tokenizer); eos: the ids that end a text,
    which the grammar allows once it is complete."""

    def __init__(self, tokenizer, vocab: int, eos: frozenset[int]):
        self._tokenizer, self.vocab, self._eos = tokenizer, vocab, sorted(eos)
        # Added tokens (Qwen's <tool_call>, ...) but the ends of text: the ones whose mask bits are checked (Constraint).
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._added = tuple(sorted(t for t in added if t < vocab and t not in eos))
        self._ll_tokenizer = None
        self._compiled: set[str] = set()  # grammars that compiled: check() passes them without compiling
        self._lock = threading.Lock()  # the server checks grammars on its intake thread, steps on another

    def _tokenizer_view(self):
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _llguidance()
                try:
                    self._ll_tokenizer = llg.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab,
                                                               eos_token=self._eos or None)
                except ValueError as err:  # a slow (Python) tokenizer
                    raise DraftwiseError(f"structured output needs a fast tokenizer: {err}") from err
            return self._ll_tokenizer

    def check(self, grammar: Grammar) -> None:
        """Raise DraftwiseError, saying why, for a grammar llguidance cannot compile (an unknown type in a schema,
        a Lark syntax error): before any work starts. A grammar that compiled once is not compiled again to be
        checked (the server checks a request's on its intake thread, then again as it joins the batch)."""
        if grammar.source in self._compiled:
            return
        self.constraint(grammar)
        with self._lock:
            if len(self._compiled) >= MAX_REMEMBERED_GRAMMARS:
                self._compiled.clear()
            self._compiled.add(grammar.source)

    def constraint(self, grammar: Grammar) -> "Constraint":
        llg = _llguidance()
        matcher = llg.LLMatcher(self._tokenizer_view(), grammar.source, log_level=0)
        if matcher.is_error():
            raise DraftwiseError(f"the {grammar.kind.replace('_', ' ')} cannot be used: {matcher.get_error()}")
        return Constraint(matcher, self.vocab, frozenset(self._eos), grammar.jump_forward, self._added)


class Constraint:
    """One sequence's place in its grammar: what it may emit next, which the engine masks the target's logits
    with, cuts drafts by and advances by the tokens it emits."""

    def __init__(self, matcher, vocab: int, eos: frozenset[int], jump_forward: bool, added: tuple[int, ...] = ()):
        self._matcher, self.vocab, self._eos, self.jump_forward = matcher, vocab, eos, jump_forward
        self._words = (vocab + 31) // 32
        self._added = torch.tensor(added, dtype=torch.long)  # [a]: the added tokens whose mask bits are checked

    def forced(self) -> list[int]:
        """The tokens the grammar allows alone from here, in order (empty where it leaves a choice). llguidance may
        spell forced text with an added token its own mask refuses (Qwen's `<tool_call>` for the text
        "<tool_call>"): the run ends before such a token, which the target could never emit there."""
        if not self.jump_forward:
            return []
        tokens = list(self._matcher.compute_ff_tokens())
        return tokens[: self.allowed_prefix(tokens)]

    def allowed_prefix(self, token_ids) -> int:
        """How many of token_ids, from the first, the grammar allows in turn from here: by its masks, which are
        what the target may emit (llguidance's validation alone is looser: it takes `c` where the mask, and so the
        target, may only write `co`)."""
        token_ids = list(token_ids)
        return self._walk_chain(self._rows(len(token_ids) + 1), token_ids)

    def shape(self, draft: Draft, room: int) -> Draft:
        """The draft the target scores: a chain up to its first forbidden guess (without it where the guess is
        one-hot or greedy, q None; with it where the draft has its own q, which the verifier's residual needs),
        then, where the grammar forces what follows the kept guesses, those tokens (jump_forward; the whole draft
        at most `room` long). A tree as it is (its forbidden nodes are masked, never kept) where it holds the whole
        run the grammar forces from here as a path; where it misses a forced token, every node from there on is
        masked, so the forced run alone, as a chain, is the better guess (the proposer then hears that it kept none
        of its own: a tree the target never scored counts as one that failed)."""
        if draft.parents is not None:
            forced = self.forced()
            return draft if _holds_path(draft, forced) else Draft(()).extended(forced[: max(0, room)])
        allowed = self.allowed_prefix(draft.token_ids)
        if allowed < len(draft) and draft.q is not None:
            return draft.prefix(allowed + 1)
        draft = draft.prefix(allowed)
        return draft.extended(self.forced_after(draft.token_ids)[: max(0, room - len(draft))])

    def forced_after(self, token_ids) -> list[int]:
        """forced() once token_ids (allowed) have come."""
        if not self.jump_forward:
            return []
        taken = sum(self._step(token) for token in token_ids)
        try:
            return self.forced()
        finally:
            self._matcher.rollback(taken)

    def mask(self, logits: torch.Tensor, draft: Draft) -> torch.Tensor:
        """logits: [n + 1, vocab], the target's rows for the draft's positions (the text's last token first).
        Returns them with every token the grammar forbids at each reachable position at -inf; positions past a
        forbidden guess are never read, and keep theirs."""
        words = self._rows(len(draft) + 1)  # [n + 1, words]
        if draft.parents is None:
            self._walk_chain(words, draft.token_ids)
        else:
            self._walk_tree(words, draft)
        return logits.masked_fill(~_expanded(words, logits.shape[-1]), float("-inf"))

    def _rows(self, n: int) -> torch.Tensor:
        return torch.full((n, self._words), -1, dtype=torch.int32)  # [n, words]: all allowed until filled

    def _walk_chain(self, words: torch.Tensor, token_ids) -> int:
        """Fill words[i] with the mask at each position of the chain while its tokens are allowed; returns how
        many were. The matcher ends where it began."""
        taken = allowed = 0
        for i in range(len(token_ids) + 1):
            self._fill(words, i)
            if i == len(token_ids) or not _allows(words[i], token_ids[i]):
                break
            taken += self._step(token_ids[i])
            allowed += 1
        self._matcher.rollback(taken)
        return allowed

    def _walk_tree(self, words: torch.Tensor, draft: Draft) -> None:
        children = draft.layout.children

        def visit(at: int) -> None:  # the matcher stands at pass position `at`
            self._fill(words, at)
            for child in children[at]:
                token = draft.token_ids[child - 1]
                if _allows(words[at], token):
                    taken = self._step(token)
                    visit(child)
                    self._matcher.rollback(taken)

        visit(0)

    def _fill(self, words: torch.Tensor, row: int) -> None:
        """The mask of allowed next tokens into words[row] ([words] int32, one bit per token id). llguidance's mask
        may allow an added token that is spelled as text the grammar wants (Qwen's `<tool_call>` where the
        grammar says "<tool_call>") though its matcher then refuses it: such bits are cleared, so that the target
        never emits a token the grammar cannot take (where no other is left, the text cannot go on: an error)."""
        target = words[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        bits = (target[self._added // 32] >> (self._added % 32)) & 1  # [a]: each added token's bit
        refused = [token for token in self._added[bits.bool()].tolist() if not self._matcher.validate_tokens([token])]
        for token in refused:
            target[token // 32] &= _without_bit(token % 32)
        if refused and not target.any():
            raise DraftwiseError(f"the grammar allows no token here: llguidance spells its text with token "
                                 f"{refused[0]}, then refuses that token; where a grammar means an added token "
                                 f"(Qwen's <tool_call>), name it by id, <[{refused[0]}]>")

    def guide(self) -> "DraftGuide":
        """The grammar as a proposer that picks guesses from its own logits sees it (Proposer.follow_grammar)."""
        return DraftGuide(self)

    def allowed_next(self) -> torch.Tensor:
        """[vocab] bool: the ids the grammar allows next."""
        words = self._rows(1)
        self._fill(words, 0)
        return _expanded(words, self.vocab)[0]

    def advance(self, token_ids: list[int]) -> None:
        """The sequence emitted these tokens (each allowed: they came from masked logits)."""
        for token in token_ids:
            self._step(token)

    def take(self, token: int) -> int:
        """One allowed token, for a while (a proposer's guess): how many the matcher took, for rollback()."""
        return self._step(token)

    def rollback(self, taken: int) -> None:
        self._matcher.rollback(taken)

    def _step(self, token: int) -> int:
        """Consume one allowed token; returns how many the matcher took (0 for the end of text after a complete
        sentence, which the stopped matcher does not take)."""
        if self._matcher.is_stopped() and token in self._eos:
            return 0
        if not self._matcher.consume_token(token):
            raise DraftwiseError(f"the grammar refused token {token}: {self._matcher.get_error()}")
        return 1

    @property
    def complete(self) -> bool:
        """The text is a whole sentence of the grammar (it may still go on where the grammar allows)."""
        return self._matcher.is_accepting()


class DraftGuide:
    """A sequence's grammar while its proposer drafts token by token: which ids may come at the next draft position
    (to mask the draft's own logits, so that its guesses keep to the grammar and are not cut), and the matcher
    moved along the guesses, then back where the text is. Guided or not, the target's verification under the mask
    keeps the output exact: this only makes guesses worth more. A sampled draft's q is then the masked distribution,
    which is the one its guesses are drawn from, as the verifier needs."""

    def __init__(self, constraint: Constraint):
        self._constraint, self._taken = constraint, 0
        self._next: torch.Tensor | None = None  # the last allowed(), which push() reads rather than asks again

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: what may follow the text and the guesses pushed so far."""
        self._next = self._constraint.allowed_next()
        return self._next

    def push(self, token: int) -> bool:
        """The proposer guessed token; False where the grammar does not allow it (the draft should end there)."""
        if self._next is not None:
            allowed = token < len(self._next) and bool(self._next[token])
        else:
            allowed = bool(self._constraint.allowed_prefix([token]))
        self._next = None
        if not allowed:
            return False
        self._taken += self._constraint.take(token)
        return True

    def reset(self) -> None:
        """The round is over: the matcher back at the text (called from the proposer's settle, whatever happened)."""
        self._constraint.rollback(self._taken)
        self._taken, self._next = 0, None


def _expanded(words: torch.Tensor, width: int) -> torch.Tensor:
    """[n, width] bool from mask words ([n, words] int32): whether each id is allowed; ids past the words' bits
    (padding rows of the logits) are not."""
    allowed = ((words.unsqueeze(-1) >> _BITS) & 1).bool().view(len(words), -1)  # [n, words * 32]
    if width > allowed.shape[1]:
        allowed = torch.cat([allowed, allowed.new_zeros(len(allowed), width - allowed.shape[1])], dim=1)
    return allowed[:, :width]


def _allows(row: torch.Tensor, token: int) -> bool:
    """Whether a mask row ([words] int32) allows the token."""
    return token < 32 * len(row) and bool((int(row[token // 32]) >> (token % 32)) & 1)


def _without_bit(bit: int) -> int:
    """An int32 word of every bit but `bit` (as a signed value, which torch's int32 takes)."""
    return (~(1 << bit) + 2**31) % 2**32 - 2**31


def _holds_path(tree: Draft, token_ids: list[int]) -> bool:
    """Whether the tree has token_ids as a path down from its root, one node a token."""
    path, _ = follow(tree.token_ids, tree.layout, lambda at, depth: token_ids[depth] if depth < len(token_ids) else None)
    return len(path) == len(token_ids)
