"""One KV cache for many sequences: a row (slot) per sequence, each with its own length.

Why not transformers' DynamicCache: it appends every new position to every row and crops every row to one
length, so rows that accepted different numbers of draft tokens would need padding holes, masks over them
and periodic compaction. Here each row has its own write position instead:

- buffers per layer: keys and values [rows, kv_heads, capacity, head_dim], grown by doubling;
- a forward of a ragged batch writes row i's n_i new positions at [len_i, len_i + N) (N = the widest row;
  a shorter row's padding lands past its length, where the next write overwrites it);
- attention reads [0, max_i(len_i) + N) of each row through a mask that shows row i, query t the keys
  [0, len_i + t] (and, for sliding-window layers, only the last `window` of those);
- trim is setting a length, so a rejected draft costs nothing to drop and nothing is ever compacted.

Active rows stay packed at 0..R-1 (a freed row takes the last one's contents), so a forward over every
sequence reads a plain slice of the buffers, never a gathered copy.
"""
from __future__ import annotations

import torch
from transformers import Cache

INITIAL_CAPACITY = 256  # positions per row before the first growth


class Slot:
    """A handle on one row. `row` moves when another slot is freed; callers keep the handle, not the row."""

    def __init__(self, row: int):
        self.row = row
        self.length = 0  # positions held
        self.open = True


class SlotCache(Cache):
    def __init__(self):
        super().__init__(layers=[])
        self.keys: list[torch.Tensor] = []  # per layer [rows, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.slots: list[Slot] = []  # slots[r].row == r
        self._rows: slice | torch.Tensor = slice(0, 0)  # the rows of the forward in progress, for reading
        self._row_index: torch.Tensor | None = None  # [B, 1] the same rows, for writing
        self._write_at: torch.Tensor | None = None  # [B, N] positions the forward writes
        self._read_end = 0

    # -- slots ----------------------------------------------------------------------------------------
    def open_slot(self) -> Slot:
        slot = Slot(len(self.slots))
        self.slots.append(slot)
        return slot

    @torch.inference_mode()  # the buffers were made in inference mode, and only change in it
    def close_slot(self, slot: Slot) -> None:
        """Free a row; the last row moves into it so the active rows stay packed."""
        if not slot.open:
            return
        slot.open = False
        last = self.slots.pop()
        if last is not slot:
            # A slot that never ran a forward (a lazily filled draft's) may have no row in the buffers yet, and
            # has nothing to move; the handles are re-pointed either way.
            if last.length:
                for buffers in (self.keys, self.values):
                    for buf in buffers:
                        buf[slot.row, :, : last.length] = buf[last.row, :, : last.length]
            last.row = slot.row
            self.slots[slot.row] = last

    # -- copies in and out (the prompt cache) --------------------------------------------------------
    @torch.inference_mode()
    def export(self, slot: Slot, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the slot's first `length` positions: per layer keys and values [kv_heads, length, head_dim]."""
        return ([buf[slot.row, :, :length].clone() for buf in self.keys],
                [buf[slot.row, :, :length].clone() for buf in self.values])

    @torch.inference_mode()
    def load(self, slot: Slot, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        """Make the slot hold the first `length` positions of exported keys and values."""
        while len(self.keys) < len(keys):
            self._add_layer(keys[len(self.keys)][None])
        self._grow(len(self.slots), length)
        for buffers, saved in ((self.keys, keys), (self.values, values)):
            for buf, layer in zip(buffers, saved):
                buf[slot.row, :, :length] = layer[:, :length]
        slot.length = length

    @torch.inference_mode()
    def keep(self, slot: Slot, start: int, sources: list[int]) -> None:
        """Move the slot's positions `sources` to start, start + 1, ... (the gather copies first, so they may
        overlap): a token tree's kept path, moved to where a chain's would be."""
        index = torch.tensor(sources)
        for buffers in (self.keys, self.values):
            for buf in buffers:
                buf[slot.row, :, start : start + len(sources)] = buf[slot.row, :, index]

    # -- one forward ----------------------------------------------------------------------------------
    def begin_forward(self, slots: list[Slot], width: int, device: torch.device) -> torch.Tensor:
        """Prepare a forward that appends `width` positions (padding included) to each of slots, in order.
        Returns the positions it writes, [B, N], which are also the new tokens' position ids."""
        rows = [s.row for s in slots]
        starts = torch.tensor([s.length for s in slots], device=device)  # [B]
        self._write_at = starts[:, None] + torch.arange(width, device=device)  # [B, N]
        self._read_end = int(starts.max()) + width
        self._row_index = torch.tensor(rows, device=device)[:, None]  # [B, 1]
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        self._rows = slice(rows[0], rows[0] + len(rows)) if contiguous else self._row_index[:, 0]
        self._grow(len(self.slots), self._read_end)
        return self._write_at

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states: [B, kv_heads, N, head_dim] -> the keys and values to attend to, [B, kv_heads, end, D]."""
        out = []
        for buf, new in zip(self.layer_buffers(layer_idx, key_states), (key_states, value_states)):
            buf[self._row_index, :, self._write_at] = new.transpose(1, 2).to(buf.dtype)  # [B, N, H, D]
            out.append(buf[self._rows, :, : self._read_end])
        return out[0], out[1]

    def layer_buffers(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's keys and values buffers [rows, kv_heads, capacity, head_dim], made on its first write in the
        dtype and heads of like ([B, kv_heads, N, head_dim])."""
        while layer_idx >= len(self.keys):  # a draft that skips layers may reach a later one first
            self._add_layer(like)
        return self.keys[layer_idx], self.values[layer_idx]

    def forward_places(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Where the forward in progress writes and reads, for a kernel that writes the cache itself: each batch
        row's cache row [B, 1], the positions it writes [B, N] (int64, contiguous) and how many it reads."""
        return self._row_index, self._write_at, self._read_end

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max((s.length for s in self.slots), default=0)

    # -- storage --------------------------------------------------------------------------------------
    def _add_layer(self, like: torch.Tensor) -> None:
        rows = max(len(self.slots), 1)
        capacity = self.keys[0].shape[2] if self.keys else self._capacity_for(self._read_end)
        shape = (rows if not self.keys else self.keys[0].shape[0], like.shape[1], capacity, like.shape[3])
        self.keys.append(like.new_zeros(shape))
        self.values.append(like.new_zeros(shape))

    def _capacity_for(self, positions: int) -> int:
        capacity = INITIAL_CAPACITY
        while capacity < positions:
            capacity *= 2
        return capacity

    def _grow(self, rows: int, positions: int) -> None:
        if not self.keys:
            return
        have_rows, _, have_positions, _ = self.keys[0].shape
        if rows <= have_rows and positions <= have_positions:
            return
        new_rows = max(rows, have_rows * 2 if rows > have_rows else have_rows)
        new_positions = self._capacity_for(positions) if positions > have_positions else have_positions
        for buffers in (self.keys, self.values):
            for i, buf in enumerate(buffers):
                bigger = buf.new_zeros((new_rows, buf.shape[1], new_positions, buf.shape[3]))
                bigger[:have_rows, :, :have_positions] = buf
                buffers[i] = bigger
