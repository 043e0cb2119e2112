"""Prompt encoding and the draft/target tokenizer check."""
from __future__ import annotations

from draftwise.errors import DraftwiseError
from draftwise.request_text import encode_chat, encode_text

_SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def _spelled(token: str | None) -> str:
    return "absent" if token is None else repr(token)


# The pair check's answer: which path a draft takes.
SHARED_TOKENIZER = "shared tokenizer"  # the draft's ids are the target's: its guesses are the target's tokens
CROSS_TOKENIZER = "cross-tokenizer"  # another vocabulary: its guesses reach the target as text (cross_vocab.py)


def tokenizer_difference(target, draft) -> str | None:
    """None where the two tokenizers are the same; else the first difference, by id (also where the two differ in
    size: that alone says nothing of which tokens differ), or the first special token they disagree on."""
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab != draft_vocab:
        by_id_target = {i: t for t, i in target_vocab.items()}
        by_id_draft = {i: t for t, i in draft_vocab.items()}
        first = min(i for i in by_id_target.keys() | by_id_draft.keys() if by_id_target.get(i) != by_id_draft.get(i))
        return (f"the draft's tokenizer differs from the target's: token id {first} is "
                f"{_spelled(by_id_target.get(first))} in the target but {_spelled(by_id_draft.get(first))} in the "
                f"draft (of {len(target)} and {len(draft)} tokens)")
    if len(target) != len(draft):
        return f"the draft's tokenizer has {len(draft)} tokens but the target's has {len(target)}"
    theirs, ours = _special_tokens(target), _special_tokens(draft)
    for name in _SPECIAL:
        if theirs[name] != ours[name]:
            return (f"the draft's tokenizer differs from the target's: {name} is {theirs[name]} in the target "
                    f"but {ours[name]} in the draft")
    return None


def draft_path(target, draft) -> str:
    """The pair check: SHARED_TOKENIZER where the draft's tokenizer is the target's, else CROSS_TOKENIZER."""
    return SHARED_TOKENIZER if tokenizer_difference(target, draft) is None else CROSS_TOKENIZER


def check_same_tokenizer(target, draft, why: str = "a draft must share the target's tokenizer") -> None:
    """Refuse a draft that tokenizes differently, naming the first difference, where the path needs the same
    tokenizer (why: what needs it)."""
    difference = tokenizer_difference(target, draft)
    if difference is not None:
        raise DraftwiseError(f"{difference}; {why}")


def _special_tokens(tokenizer) -> dict:
    return {name: getattr(tokenizer, name) for name in _SPECIAL}


def readable_ids(tokenizer, embedding_rows: int) -> int:
    """How many ids, from 0, a prompt may hold: the tokenizer's tokens, as far as the model's embedding (of
    embedding_rows rows: a backend's member of that name) reads them."""
    return min(len(tokenizer), embedding_rows)


def check_draft_reads_every_token(tokenizer, target_rows: int, draft_rows: int) -> None:
    """A draft model whose embedding has fewer rows (draft_rows) than there are ids to read (the tokenizer's tokens,
    as far as the target's own embedding, of target_rows, reads them) would fail mid-generation: refuse it before
    anything runs. Rows past those are padding, which real pairs differ in (Qwen2.5's 7B pads to 152,064 ids, its
    0.5B to 151,936)."""
    rows = draft_rows
    needed = readable_ids(tokenizer, target_rows)
    if rows < needed:
        raise DraftwiseError(f"the draft model reads {rows} token ids but the target and its tokenizer use {needed}; "
                             "a draft must share the target's tokenizer")


def encode_prompt(tokenizer, prompt: str | list[int] | list[dict], chat: bool,
                  trust_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
    """Text, token ids, or chat messages -> token ids. chat=True wraps a string as one user turn.
    Control tokens spelled in the text stay text unless trust_special_tokens (request_text.py).
    tools: function definitions for a chat template that renders them."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    elif chat or isinstance(prompt, list):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not getattr(tokenizer, "chat_template", None):
            raise DraftwiseError("this model's tokenizer has no chat template; drop --chat and give plain text")
        ids = encode_chat(tokenizer, messages, trust_special_tokens, tools)
    else:
        ids = encode_text(tokenizer, prompt, trust_special_tokens)
    if not ids:
        raise DraftwiseError("the prompt is empty: give at least one token of text")
    return ids


def eos_ids(tokenizer, *model_configs) -> frozenset[int]:
    """Every id that ends a sequence: the tokenizer's and the configs' (chat models list several)."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, *(getattr(c, "eos_token_id", None) for c in model_configs)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)
