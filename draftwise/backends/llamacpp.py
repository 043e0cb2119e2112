"""llama.cpp as a backend: the GGUF file as published, one llama.cpp context shared by many sequences.

Each slot is a llama.cpp sequence id with its own stream of cache cells; a ragged batch of slots is one
llama_decode (each row's tokens under its own sequence id and positions, logits at every position). Rolling
back is dropping a sequence's cells past a position.

Batch invariance, which makes every method's greedy output that of `none`: llama.cpp's CPU kernels take other
paths (and round differently) for narrow passes than for wide ones: one row against several (llamafile's tinyBLAS
starts at two), and again below eight tokens for quantized weights. So no pass is narrower than MIN_WIDTH: every
row is padded to the widest row's length, and to at least MIN_WIDTH, with its own last token at the positions
after its own, where no real token looks and the next pass overwrites them; the padding is scored too, so the
output layer sees as many rows. With LlamaSettings' defaults (llamacpp_api.py) that makes a position's logits the
same bits in one-token steps, a chain, a prefill chunk or a row of a ragged batch; a one-token step then costs an
eight-token pass.

Not served here, as LlamaCppBackend.capabilities declares: token trees (no tree attention mask per row), hidden
states, running some of the layers and the prompt cache, so the methods that need them (tree methods, head,
skip) are refused when an engine is built (methods.py); asked anyway, the backend raises a DraftwiseError.
"""
from __future__ import annotations

import torch

from draftwise.backends.base import SharedBackend, SlotView
from draftwise.backends.capabilities import BackendCapabilities
from draftwise.backends.llamacpp_api import LlamaContext, LlamaSettings
from draftwise.errors import DraftwiseError

MIN_WIDTH = 8  # the narrowest pass: narrower ones take other kernels (see the module's docstring)
PAD_ROOM = 64  # cells per sequence past max_context, for a short row's padding at the end of the context
DEFAULT_SLOTS = 8  # sequences one backend holds at once: the server's batch, or a draft model's slots
DEFAULT_CONTEXT = 4096  # positions per sequence, unless the model was trained on fewer


class LlamaSequence:
    """One slot's state: its llama.cpp sequence id and how many of its positions are the text's."""

    def __init__(self, seq_id: int):
        self.seq_id = seq_id
        self.length = 0
        self.open = True


class LlamaCppBackend(SharedBackend):
    """A GGUF model in llama.cpp, as a SharedBackend (base.py): slots open and close; forward_batch scores a
    ragged batch of them in one decode (several when it holds more than the context's batch of tokens)."""

    backend_name = "llamacpp"
    # Batch-invariant at min_width=MIN_WIDTH with LlamaSettings' defaults (a draft's backend may take min_width=1).
    capabilities = BackendCapabilities(batch_invariant=True)

    def __init__(self, gguf_path: str, slots: int = DEFAULT_SLOTS, context: int = DEFAULT_CONTEXT,
                 settings: LlamaSettings = LlamaSettings(), min_width: int = MIN_WIDTH):
        """min_width: the narrowest pass (MIN_WIDTH keeps the logits invariant; 1 is the control that shows why)."""
        self._min_width = min_width
        self._llama = LlamaContext(str(gguf_path), slots, context + PAD_ROOM, settings)
        self.vocab_size: int = self._llama.vocab_size
        self.max_context: int = min(context, self._llama.trained_context or context)
        self._slots = slots  # sequences the context holds at once
        self._free = list(range(slots))  # sequence ids not in use
        self.feature_layers: tuple[int, ...] = ()  # (no hidden states here: never read)
        self.default = self.open_slot()

    device = property(lambda self: torch.device("cpu"))
    dtype = property(lambda self: torch.float32)  # of the logits; the weights are the file's own blocks
    embedding_rows = property(lambda self: self.vocab_size)

    @property
    def model(self):
        raise DraftwiseError("the llama.cpp backend runs no torch module whose layers could be reached; the methods "
                             "that need them run on --backend hf")

    @property
    def open_slots(self) -> int:
        return self._slots - len(self._free)

    def open_slot(self) -> "LlamaSlot":
        if not self._free:
            raise DraftwiseError(f"all {self._slots} sequences of the llama.cpp context are in use; load "
                                 "the backend with more slots")
        return LlamaSlot(self, LlamaSequence(self._free.pop(0)))

    def close_slot(self, view: "LlamaSlot") -> None:
        seq = view.slot
        if not seq.open:
            return
        seq.open = False
        self._llama.forget(seq.seq_id)
        self._free.append(seq.seq_id)

    def attach_prompt_cache(self, cache, name: str) -> None:
        raise DraftwiseError("the llama.cpp backend keeps no prompt cache (its slots restore nothing); the prompt "
                             "cache runs on --backend hf or quant")

    # -- ragged batches --------------------------------------------------------------------------------
    def forward_batch(self, rows: list[tuple["LlamaSlot", list[int]]], logits: bool = True,
                      trees: list | None = None, hidden: bool = False):
        """Append each row's new ids to its slot; return float32 logits [n_i, vocab] per row (empty when not
        logits). Lengths move only once the whole pass has succeeded. trees and hidden are refused."""
        if hidden:
            raise DraftwiseError("the llama.cpp backend gives no hidden states; the methods that read them run "
                                 "on --backend hf")
        if trees is not None and any(tree is not None for tree in trees):
            raise DraftwiseError("the llama.cpp backend scores no token trees; tree methods run on --backend hf")
        seqs = [view.slot for view, _ in rows]
        lengths = [len(ids) for _, ids in rows]
        if min(lengths) < 1:
            raise DraftwiseError("every row of a forward needs at least one new token")
        width = max(self._min_width, *lengths)
        for seq, n in zip(seqs, lengths):
            if seq.length + n > self.max_context:
                raise DraftwiseError(
                    f"sequence of {seq.length + n} tokens exceeds the model's context of {self.max_context}")
        for seq in seqs:  # cells past a slot's length (rejected drafts, padding) would be seen as text
            self._llama.forget(seq.seq_id, seq.length)
        padded = [ids + [ids[-1]] * (width - len(ids)) for _, ids in rows]  # [B, W]
        out = self._decode_columns(seqs, padded, logits)
        for seq, n in zip(seqs, lengths):
            seq.length += n
        if not logits:
            return [torch.empty(0, self.vocab_size) for _ in rows]
        return [row[:n] for row, n in zip(out, lengths)]  # [n_i, vocab] each

    def _decode_columns(self, seqs: list[LlamaSequence], padded: list[list[int]], logits: bool) -> list[torch.Tensor]:
        """Decode every row's padded ids, as many columns per llama_decode as the batch holds (never fewer than
        MIN_WIDTH: a last narrow chunk repeats each row's last id once more). Returns logits [W, vocab] per row;
        without logits, only the last position of a chunk is scored (llama.cpp wants one)."""
        rows, width = len(padded), len(padded[0])
        narrowest = self._min_width
        step = max(narrowest, self._llama.batch_size // rows)
        if rows * narrowest > self._llama.batch_size:
            raise DraftwiseError(f"{rows} rows do not fit one llama.cpp batch of {self._llama.batch_size} tokens")
        per_row: list[list[torch.Tensor]] = [[] for _ in padded]
        for start in range(0, width, step):
            columns = [ids[start: start + step] for ids in padded]
            columns = [c + [c[-1]] * (narrowest - len(c)) for c in columns]  # [B, w]
            w = len(columns[0])
            tokens = [t for c in columns for t in c]
            positions = [seq.length + start + j for seq in seqs for j in range(w)]
            ids = [seq.seq_id for seq in seqs for _ in range(w)]
            outputs = [True] * len(tokens) if logits else [i == len(tokens) - 1 for i in range(len(tokens))]
            scores = self._llama.decode(tokens, positions, ids, outputs)
            if logits:
                for r in range(rows):
                    per_row[r].append(torch.from_numpy(scores[r * w: (r + 1) * w]))
        return [torch.cat(chunks)[:width] for chunks in per_row] if logits else []

    def close(self) -> None:
        self._llama.close()


class LlamaSlot(SlotView):
    """One sequence's view of a LlamaCppBackend. The single-sequence methods are SlotView's (each a forward_batch
    of one row, so the same padding rule holds; trim only sets the length: the cells past it go before the next
    decode); what the backend cannot do is refused or, for the prompt cache, reported as nothing cached (as a
    slot of a backend with no prompt cache attached reports it)."""

    def keep(self, start: int, sources: list[int]) -> None:
        raise DraftwiseError("the llama.cpp backend keeps no token tree's path; tree methods run on --backend hf")
