"""A trained feature head drafts token trees (EAGLE-2, Li et al. 2024) from the target's own hidden states.

The head (head_model.py) costs one decoder layer and a readout over the common tokens per forward, a few
percent of the target, and every forward expands a whole depth of the tree at once.

Features: the engine hands over the target's last hidden state at every text position the target has read
(add_features: from prefill chunks, and after each round from the verification pass, the kept path's rows).
The head's cache holds its inputs (f_t, x_{t+1}, and x_t for a head that reads it) for positions whose true
feature it has seen; a round feeds the positions new since the last, then grows the tree on top with its own
predicted features, and trims those speculative entries away at the end (settle), so the cache never holds
anything but the verified text.

The tree: depth 1 is the `branch` likeliest tokens after the text; each further depth expands the `width`
likeliest nodes of the one before (likeliness: the product of the head's probabilities along the path, which
tracks how likely the target is to keep the path), each by its `branch` likeliest tokens, while one more depth
can pay for its forward (tree_growth.py). Of every node grown, the likeliest `n` form the draft (a parent is
always at least as likely as its child, so they form a tree), n chosen by the measured costs: one more node is
worth its place while the expected tokens per second of the round still rise with it, verification of each
width priced by what the engine has measured on this machine.
Every guess is one-hot, so the tree verifier keeps the output exact whatever the head proposes.

Window: the head attends back at most as far as 98% of its training sequences reach (attention_window). Its
rotary positions are relative, and distances it never saw in training give it features it cannot read: unbounded,
it keeps almost none of its guesses on long prompts (summaries of an article) and runs slower than the target
alone there. The window also bounds a long prompt's catch-up:
only its last `window` positions are fed.

Prompt cache: a restored prefix is not run through the target again, so its features would never arrive and the
head would draft from the positions after it alone (on the tiny test model it kept less than half as many guesses).
While the engine's prompt cache is on, the head keeps a record of the text's features (TextFeatures: a tenth of
what the target keeps a token for Qwen2.5-Coder 1.5B, 1,536 values against 14,336) and offers it beside the
target's entry; a restored prompt then gives the head the features a cold prefill would have, so the same guesses.
"""
from __future__ import annotations

import time

import torch

from draftwise.backends.prefix_cache import PrefixCache, features_entry
from draftwise.config import SamplingConfig
from draftwise.proposers.base import Capabilities, Proposer
from draftwise.proposers.head_model import FeatureHead, HeadCache, with_room
from draftwise.proposers.tree_growth import BRANCH, GrownTree, SizedTree, TreeSizing, as_draft, grow
from draftwise.types import Draft


class HeadProposer(SizedTree, Proposer):
    # The engine hands the target's hidden states over (add_features). No draft model, no cache of the text to fill
    # (a restored prompt's features come from the prompt cache: restore), and no steps to share in a batch: the head
    # drafts at once.
    capabilities = Capabilities(drafts_trees=True, reads_target_features=True)

    def __init__(self, head: FeatureHead, readout: torch.nn.Linear, readout_ids: torch.Tensor, embed: torch.nn.Module,
                 sizing: TreeSizing | None = None, window: int | None = None, prompt_cache: PrefixCache | None = None):
        """window: how far back the head attends (None: the whole text); see attention_window(). prompt_cache: the
        engine's, where the text's features are kept (attach_prompt_cache)."""
        self.head, self.readout, self.embed = head, readout, embed
        self.window = window
        self.readout_ids = readout_ids  # [R]: the target id of each readout row
        self.sizing = sizing or TreeSizing()  # how many grown nodes to offer (tree_growth.py)
        self.speed_paths: dict = {}  # what loading chose (folder, parameters, kernels), for the stats
        self.cache = HeadCache()
        self._fed = 0  # text positions below this have their input in the cache (or were never seen)
        self._features: torch.Tensor | None = None  # [n, H] true features from position _features_at on
        self._features_at = 0
        self._root_feature: torch.Tensor | None = None  # [H] the head's f-hat at the text's last position
        self._root_logits: torch.Tensor | None = None  # [R] its readout: what follows the text
        self._prompt_cache = prompt_cache
        self._text = TextFeatures()  # every true feature of the text from position 0, while a prompt cache is on

    # -- the sequence --------------------------------------------------------------------------------------
    def begin(self, prompt_ids: list[int], sampling: SamplingConfig, generator: torch.Generator) -> None:
        self.cache.trim(0)
        self._fed, self._features, self._features_at = 0, None, 0
        self._root_feature = self._root_logits = None
        self._text.clear()

    def add_features(self, start: int, features: torch.Tensor) -> None:
        """The target's features [n, H] at text positions start, start + 1, ... (what it read there)."""
        if self._prompt_cache is not None:
            self._text.add(start, features)
        if self._features is not None and start == self._features_at + len(self._features):
            self._features = torch.cat([self._features, features])
        else:  # a gap (a prompt-cached prefix the target never recomputed): the head goes on from here
            self._features, self._features_at = features, start
        # Only the window's positions are ever fed (_catch_up): while lookup wins a hybrid's rounds, the rest would
        # pile up for as long as the streak lasts.
        surplus = len(self._features) - self.window if self.window else 0
        if surplus > 0:
            self._features, self._features_at = self._features[surplus:], self._features_at + surplus

    def observe(self, num_accepted: int) -> None:
        """How far the tree's chances were borne out (TreeSizing.trust); the verified text's features arrive
        through add_features."""
        self.sizing.observe(num_accepted)

    def fork(self) -> "HeadProposer":
        return HeadProposer(self.head, self.readout, self.readout_ids, self.embed,
                            TreeSizing(self.sizing.costs, self.sizing.max_nodes), self.window, self._prompt_cache)

    # -- the prompt cache: the text's features, beside the target's keys and values ---------------------------
    def attach_prompt_cache(self, cache: PrefixCache) -> None:
        self._prompt_cache = cache

    def restore(self, token_ids: list[int]) -> int:
        """The features of the longest prefix of token_ids that the prompt cache holds, as a prefill would have
        handed them over; returns its length (where it falls short of the target's, the head goes on from the
        first position the target computes, as without a cache)."""
        if self._prompt_cache is None:
            return 0
        entry, length = self._prompt_cache.longest(self._entry_name, token_ids)
        if entry is not None:  # (a server's feature capture keeps its entry on the CPU: see serve/feature_capture.py)
            self.add_features(0, entry.keys[0][:length].to(self.head.input_norm.weight.device))
        return length

    def remember(self, text: list[int]) -> None:
        """Offer the features of the text (all but its last token) to the prompt cache."""
        length = min(len(self._text), len(text))
        if self._prompt_cache is not None and length:
            self._prompt_cache.put(self._entry_name, text[:length], [self._text.rows(length).clone()], [])

    @property
    def _entry_name(self) -> str:
        """The prompt cache's name for these features: the target's, of the layers this head reads (every head of
        the engine reads the same)."""
        return features_entry(self.feature_layers)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target's decoder layers a fused head reads beside the last one."""
        return self.head.config.feature_layers

    # -- a round -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
        last = len(context) - 1  # the text's last token, at position `last`, heads the next target pass
        if k < 1 or not self._catch_up(context, last):
            return Draft(token_ids=())
        started = time.perf_counter()  # the tree's forwards only: catch-up grows with the rounds sat out
        kept = len(self.cache)
        try:
            tree, expanded = self._grow(last, context[last], depth=k)
        finally:
            self.cache.trim(kept)  # the speculative entries go; only verified text stays cached
        if expanded:
            self.sizing.time_forwards(time.perf_counter() - started, expanded)
        # The round's forwards: the catch-up's (it gave depth 1) and one per depth expanded.
        return as_draft(tree.tokens, tree.parents, self.sizing.choose(tree, k, 1 + expanded))[0]

    def _catch_up(self, context: list[int], last: int) -> bool:
        """Feed the inputs (f_t, x_{t+1}, x_t) of every position t < last not yet fed; False without f_{last - 1}."""
        if self._features is None or self._features_at + len(self._features) < last:
            return False
        window_start = last - self.window if self.window else 0
        start = max(self._fed, self._features_at, window_start)
        if start >= last:
            return self._root_logits is not None and self._fed == last
        if start == window_start > self._fed:  # everything cached lies before the window: none of it is seen
            self.cache.trim(0)
        device = self.head.input_norm.weight.device
        features = self._features[start - self._features_at : last - self._features_at]  # [n, H]
        ids = torch.tensor(context[start : last + 1], device=device)  # [n + 1]: x_t, then x_{t+1} at the last
        embedded = self.embed(ids)[None]  # [1, n + 1, H]
        predicted, (keys, values) = self.head(features[None].to(device, self.head.input_norm.weight.dtype),
                                              embedded[:, 1:], torch.arange(start, last, device=device),
                                              past=self.cache.view(self.window), return_kv=True,
                                              current=embedded[:, :-1])
        root_logits = self.readout(predicted[0, -1:])[0].float()  # [R]: what follows x_last
        self.cache.append(keys, values)  # state changes only once everything it depends on has been computed
        self._fed = last
        self._root_feature, self._root_logits = predicted[0, -1], root_logits  # f-hat at position last, its readout
        self._features = self._features[last - self._features_at :]  # keep only what is not fed yet
        self._features_at = last
        return True

    def _grow(self, last: int, last_token: int, depth: int) -> tuple[GrownTree, int]:
        """Grow up to `depth` levels (tree_growth.grow), one head forward per depth past the first, while one more
        can pay, over the nodes that do (TreeSizing.to_expand). Returns the tree and the forwards it ran.
        last_token: the text's last token, at whose position the root's feature was predicted."""
        predicted: dict[int, torch.Tensor] = {}  # an expanded node's predicted feature [H]: its children's input
        speculative: list[int] = []  # the node of each speculative cache entry, in cache order
        level = [0]  # the depth of the nodes expanded: grow expands one depth per call

        def expand(tree: GrownTree, nodes: list[int]):
            started = time.perf_counter()
            level[0] += 1
            parents = [tree.parents[n] for n in nodes]
            # Each node reads its parent's predicted feature and, as the token that feature was predicted at, its
            # parent's token (the root's: the text's last feature and token).
            parent_features = [predicted.get(p, self._root_feature) for p in parents]
            parent_tokens = [tree.tokens[p] if p >= 0 else last_token for p in parents]
            outputs = self._expand(nodes, tree, parent_features, parent_tokens, speculative, last + level[0])
            speculative.extend(nodes)
            predicted.update(zip(nodes, outputs))
            candidates = self._candidates(self.readout(outputs))  # [len(nodes), BRANCH] each
            self.sizing.time_expansion(len(nodes), time.perf_counter() - started)
            return candidates

        first = [row[0] for row in self._candidates(self._root_logits[None])]  # [BRANCH] each, from the catch-up
        return grow(first, depth, expand, sizing=self.sizing), level[0]

    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [n, R] -> (log-probabilities, target ids) of each row's BRANCH likeliest tokens, [n, BRANCH]."""
        top = torch.log_softmax(logits.float(), -1).topk(BRANCH, dim=-1)
        # The tree is grown on the CPU, where readout_ids are, whatever the head's device.
        return top.values.cpu(), self.readout_ids[top.indices.cpu()]

    def _expand(self, nodes: list[int], tree: GrownTree, parent_features: list[torch.Tensor],
                parent_tokens: list[int], speculative: list[int], position: int) -> torch.Tensor:
        """One head forward over `nodes` (all at one depth, text position `position`): each reads its parent's
        predicted feature and token (read only by a head that reads the current token) and its own token, and sees
        the verified cache and its own ancestors' entries.
        Returns their predicted features [N, H]."""
        device = self.head.input_norm.weight.device
        # The verified text's entries within the window, then this round's speculative ones.
        past = self.cache.view(None if self.window is None else self.window + len(speculative))
        shown = 0 if past is None else past[0].shape[2]
        fed = shown - len(speculative)
        mask = torch.zeros(len(nodes), shown + len(nodes), dtype=torch.bool)  # [N, shown + N]
        mask[:, :fed] = True
        for row, node in enumerate(nodes):
            ancestors = _ancestors(node, tree.parents)
            mask[row, fed:shown] = torch.tensor([n in ancestors for n in speculative], dtype=torch.bool)
            mask[row, shown + row] = True
        ids = torch.tensor([tree.tokens[n] for n in nodes] + parent_tokens, device=device)  # [2N]: own, then parents'
        embedded = self.embed(ids)[None]  # [1, 2N, H]
        inputs = torch.stack(parent_features)[None]  # [1, N, H]
        positions = torch.full((len(nodes),), position - 1, device=device)  # [N]
        out, (keys, values) = self.head(inputs, embedded[:, : len(nodes)], positions, past=past, mask=mask.to(device),
                                        return_kv=True, current=embedded[:, len(nodes) :])
        self.cache.append(keys, values)
        return out[0]  # [N, H]


class TextFeatures:
    """The target's features of one sequence's text from its first position on, [length, F], grown by doubling; a
    gap in what arrives (a prefix restored without its features) ends the record until the next sequence."""

    def __init__(self):
        self._rows: torch.Tensor | None = None
        self._length = 0
        self._broken = False

    def __len__(self) -> int:
        return 0 if self._broken else self._length

    def clear(self) -> None:
        self._length, self._broken = 0, False

    def add(self, start: int, features: torch.Tensor) -> None:
        """features: [n, F] at positions start, start + 1, ...; positions already held are overwritten."""
        if self._broken or start > self._length:
            self._broken = True
            return
        end = start + len(features)
        self._rows = with_room(self._rows, start, end, features, dim=0)
        self._rows[start:end] = features
        self._length = end

    def rows(self, length: int) -> torch.Tensor:
        """The first `length` positions' features [length, F] (a view: copy what must outlive the sequence)."""
        return self._rows[:length]


def _ancestors(node: int, parents: list[int]) -> set[int]:
    found = set()
    while node >= 0:
        found.add(node)
        node = parents[node]
    return found


def attention_window(config) -> int | None:
    """How far back a head may attend: its training's window (train.attention_window_of); for a head trained before
    the window was recorded, its longest training sequence, else its training seq_len; else None (no record)."""
    training = config.training or {}
    return (training.get("window") or training.get("longest_sequence")
            or (training.get("config") or {}).get("seq_len"))
