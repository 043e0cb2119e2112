"""Which replica has a request's prefix in its prompt cache: the memory of the router in front of the replicas.

A replica's prompt cache keeps the keys and values of the texts it served, so a request that starts as an earlier
one did (a chat's next turn, a shared system prompt) is cheaper where that earlier one ran. The router cannot see
the caches; it remembers instead where it sent each text, as chained hashes of its blocks of BLOCK_CHARS
characters (so a lookup costs one dictionary probe per block, not a comparison with every text seen), and
forgets the least recently used blocks past a bound. Text rather than tokens: the router has no tokenizer, and a
shared prefix of text is a shared prefix of tokens but for the last block.
"""
from __future__ import annotations

import json
from collections import OrderedDict

BLOCK_CHARS = 64  # about 16 tokens of English or code
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


def routing_text(path: str, body: bytes) -> str:
    """The text whose prefix decides where a request goes: a completion's prompt, or a chat's messages in order
    (role and content; a chat's next turn extends its last one). "" where there is none to go by."""
    if path not in ROUTED_PATHS:
        return ""
    try:
        request = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(request, dict):
        return ""
    if path == "/v1/completions":
        prompt = request.get("prompt")
        return prompt if isinstance(prompt, str) else json.dumps(prompt) if prompt is not None else ""
    messages = request.get("messages")
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if isinstance(message, dict):
            content = message.get("content")
            parts.append(f"{message.get('role')}\x1f{content if isinstance(content, str) else json.dumps(content)}")
    # (the tools a request offers go before its messages in the template, so they lead here too)
    tools = json.dumps(request["tools"]) if request.get("tools") else ""
    return tools + "\x1e".join(parts)


def block_keys(text: str) -> list[int]:
    """One key per whole block of text: each the hash of the text up to that block's end (chained)."""
    keys, key = [], 0
    for end in range(BLOCK_CHARS, len(text) + 1, BLOCK_CHARS):
        key = hash((key, text[end - BLOCK_CHARS:end]))
        keys.append(key)
    return keys


class PrefixIndex:
    """Where each block-prefix of the routed texts went, for at most max_blocks of them (least recent go)."""

    def __init__(self, max_blocks: int = 200_000):
        self.max_blocks = max_blocks
        self._holders: OrderedDict[int, set] = OrderedDict()  # block key -> replicas sent a text with it

    def add(self, replica, text: str) -> None:
        for key in block_keys(text):
            holders = self._holders.pop(key, set())
            holders.add(replica)
            self._holders[key] = holders  # (now the most recent)
        while len(self._holders) > self.max_blocks:
            self._holders.popitem(last=False)

    def longest(self, text: str, replicas) -> tuple[object | None, int]:
        """(the replica among `replicas` that was sent the longest prefix of text, its length in characters);
        (None, 0) when none was sent even one block of it. Ties go to the first in `replicas`."""
        candidates = list(replicas)
        best, best_chars = None, 0
        for blocks, key in enumerate(block_keys(text), start=1):
            holders = self._holders.get(key)
            held = [r for r in candidates if holders and r in holders]
            if not held:
                break
            best, best_chars, candidates = held[0], blocks * BLOCK_CHARS, held
        return best, best_chars

    def forget(self, replica) -> None:
        """A replica died: its cache went with it."""
        for key in list(self._holders):
            holders = self._holders[key]
            holders.discard(replica)
            if not holders:
                del self._holders[key]

    def __len__(self) -> int:
        return len(self._holders)
