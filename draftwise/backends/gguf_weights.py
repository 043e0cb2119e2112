"""A GGUF file's quantized blocks, read as published into the layout qgemm.c multiplies by.

Every type read here maps exactly onto one form: w[n, k] = d[n, s] * sc[n, g] * q[n, k] - dmin[n, s] * mn[n, g],
q unsigned, g = k // group its group, s = g // supers its super-group (groups of `group` values, `supers` groups a
super-group). The integers and scales are the file's own; nothing is re-quantized from floats.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from draftwise.errors import DraftwiseError

TILE = 16  # output channels per tile (qgemm.c)


@dataclass
class Blocks:
    """One weight [n, k] in per-channel form: q [n, k] uint8, sc and mn [n, k/group] int8, d and dmin
    [n, k/(group*supers)] float32."""

    q: np.ndarray
    sc: np.ndarray
    mn: np.ndarray
    d: np.ndarray
    dmin: np.ndarray
    group: int
    supers: int
    bits: int  # what every q fits in: 4, 6 or 8 (how qgemm.c stores them)

    def dequantize(self) -> np.ndarray:
        """[n, k] float32: what the blocks stand for (for checks; the kernel never forms it)."""
        n, k = self.q.shape
        per_group = lambda a: np.repeat(a, self.group, axis=1)  # noqa: E731  [n, groups] -> [n, k]
        per_super = lambda a: np.repeat(a, self.group * self.supers, axis=1)  # noqa: E731
        scale = per_super(self.d) * per_group(self.sc).astype(np.float32)
        low = per_super(self.dmin) * per_group(self.mn).astype(np.float32)
        return scale * self.q.astype(np.float32) - low

    def rows(self, order: np.ndarray) -> "Blocks":
        """The same weight with its output channels taken in `order`."""
        scales = self.sc[order]
        return Blocks(self.q[order], scales, scales if self.mn is self.sc else self.mn[order], self.d[order],
                      self.dmin[order], self.group, self.supers, self.bits)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _q4_k(blocks: np.ndarray):  # 144 bytes: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 of nibbles
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    packed = blocks[:, 4:16].reshape(-1, 3, 4)
    a, b, c = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)  # [blocks, 8]
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(-1, 256), sc, mn, d, dmin, 32, 8


def _q6_k(blocks: np.ndarray):  # 210 bytes: 128 low nibbles, 64 of 2-bit highs, 16 int8 scales, d (f16)
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(-1, 2, 2, 64)  # [blocks, half, nibble, 64]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(-1, 2, 4, 32)
    q = (ql.reshape(-1, 2, 4, 32) | (qh << 4)).reshape(-1, 256)  # 0..63, the file's value + 32
    sc = blocks[:, 192:208].copy().view(np.int8)  # [blocks, 16]
    d = _f16(blocks[:, 208:210])
    return q, sc, sc, d, 32 * d, 16, 16  # d * sc * (q - 32)


def _q5_0(blocks: np.ndarray):  # 22 bytes: d (f16), 32 high bits, 16 bytes of nibbles; w = d * (q - 16)
    d = _f16(blocks[:, 0:2])
    high = blocks[:, 2:6].copy().view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
    low = blocks[:, 6:22].reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    q = (low & 0x0F).reshape(-1, 32) | ((high & 1).astype(np.uint8) << 4)
    return q, *_unit_scales(len(blocks)), d, 16 * d, 32, 1


def _q8_0(blocks: np.ndarray):  # 34 bytes: d (f16), 32 int8; w = d * q
    d = _f16(blocks[:, 0:2])
    q = (blocks[:, 2:34].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, *_unit_scales(len(blocks)), d, 128 * d, 32, 1


def _q4_0(blocks: np.ndarray):  # 18 bytes: d (f16), 16 bytes of nibbles; w = d * (q - 8)
    d = _f16(blocks[:, 0:2])
    return _nibbles(blocks[:, 2:18]), *_unit_scales(len(blocks)), d, 8 * d, 32, 1


def _q4_1(blocks: np.ndarray):  # 20 bytes: d, m (f16), 16 bytes of nibbles; w = d * q + m
    d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, _ = _unit_scales(len(blocks))
    return _nibbles(blocks[:, 4:20]), sc, -sc, d, m, 32, 1


def _nibbles(qs: np.ndarray) -> np.ndarray:
    return (qs.reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1) & 0x0F).reshape(-1, 32)


def _unit_scales(blocks: int):
    ones = np.ones((blocks, 1), dtype=np.int8)
    return ones, ones


# GGUF type name -> (bytes a block, values a block, decoder, bits a value needs)
DECODERS = {"Q4_K": (144, 256, _q4_k, 4), "Q6_K": (210, 256, _q6_k, 6), "Q5_0": (22, 32, _q5_0, 6),
            "Q8_0": (34, 32, _q8_0, 8), "Q4_0": (18, 32, _q4_0, 4), "Q4_1": (20, 32, _q4_1, 4)}


def decode(type_name: str, raw: np.ndarray, n: int, k: int) -> Blocks:
    """A tensor's raw bytes [n, k / values * bytes] -> Blocks, or an error naming the types read."""
    if type_name not in DECODERS:
        raise DraftwiseError(f"the quant backend reads {', '.join(DECODERS)} weights, not {type_name}")
    size, values, decoder, bits = DECODERS[type_name]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * (k // values), size)
    q, sc, mn, d, dmin, group, supers = decoder(blocks)
    groups, super_groups = k // group, k // (group * supers)
    scales = sc.reshape(n, groups).astype(np.int8)
    mins = scales if mn is sc else mn.reshape(n, groups).astype(np.int8)  # Q6_K: one array, read once
    return Blocks(q.reshape(n, k).astype(np.uint8), scales, mins, d.reshape(n, super_groups).astype(np.float32),
                  dmin.reshape(n, super_groups).astype(np.float32), group, supers, bits)


@dataclass
class Packed:
    """Blocks in qgemm.c's tile layout (tile of 16 channels outermost), as flat contiguous arrays."""

    q: np.ndarray
    sc: np.ndarray
    mn: np.ndarray
    d: np.ndarray
    dmin: np.ndarray
    n: int
    k: int
    group: int
    supers: int
    bits: int

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.q, self.sc, self.mn, self.d, self.dmin))


def pack(blocks: Blocks) -> Packed:
    """Tile-major layout; channels padded to a multiple of 16 with zero scales (their outputs are dropped)."""
    n, k = blocks.q.shape
    padded = -n % TILE
    if padded:
        pad = lambda a: np.pad(a, ((0, padded), (0, 0)))  # noqa: E731
        scales = pad(blocks.sc)
        blocks = Blocks(pad(blocks.q), scales, scales if blocks.mn is blocks.sc else pad(blocks.mn), pad(blocks.d),
                        pad(blocks.dmin), blocks.group, blocks.supers, blocks.bits)
    tiles, g = (n + padded) // TILE, blocks.group
    groups, half = k // g, g // 8
    # [tiles, groups, vec, channel, 4]: register `vec` holds 4 consecutive values of each of the 16 channels
    q = blocks.q.reshape(tiles, TILE, groups, g // 4, 4).transpose(0, 2, 3, 1, 4)
    if blocks.bits < 8:  # registers i and i + half share bytes: low and high nibble
        low = q & 0x0F
        planes = [low[:, :, :half] | (low[:, :, half:] << 4)]
        if blocks.bits == 6:  # then each byte holds the 2-bit high parts of four registers
            high = (q >> 4).reshape(tiles, groups, g // 16, 4, TILE, 4)
            planes.append(sum(high[:, :, :, b] << (2 * b) for b in range(4)).astype(np.uint8))
        q = np.concatenate(planes, axis=2)
    by_tile = lambda a: np.ascontiguousarray(a.reshape(tiles, TILE, -1).transpose(0, 2, 1)).ravel()  # noqa: E731
    scales = by_tile(blocks.sc)
    mins = scales if blocks.mn is blocks.sc else by_tile(blocks.mn)  # shared: the kernel reads the same bytes
    return Packed(np.ascontiguousarray(q).ravel(), scales, mins, by_tile(blocks.d), by_tile(blocks.dmin), n, k, g,
                  blocks.supers, blocks.bits)


def unpack(packed: Packed) -> Blocks:
    """The per-channel blocks of a packed weight: pack's inverse (its padded channels dropped)."""
    tiles, g = -(-packed.n // TILE), packed.group
    groups, half = packed.k // g, g // 8
    if packed.bits == 8:
        q = packed.q.reshape(tiles, groups, g // 4, TILE, 4)
    else:
        planes = packed.q.reshape(tiles, groups, -1, TILE, 4)  # [tiles, groups, vec bytes, channel, 4]
        q = np.concatenate([planes[:, :, :half] & 0x0F, planes[:, :, :half] >> 4], axis=2)  # the low nibbles
        if packed.bits == 6:  # each byte: the 2-bit high parts of four registers
            high = np.stack([(planes[:, :, half:] >> (2 * b)) & 0x03 for b in range(4)], axis=3)
            q = q | (high.reshape(q.shape) << 4)
    q = q.transpose(0, 3, 1, 2, 4).reshape(tiles * TILE, packed.k)  # [channels, k]
    by_channel = lambda a: a.reshape(tiles, -1, TILE).transpose(0, 2, 1).reshape(tiles * TILE, -1)  # noqa: E731
    n = packed.n
    scales = by_channel(packed.sc)[:n]
    mins = scales if packed.mn is packed.sc else by_channel(packed.mn)[:n]
    return Blocks(q[:n], scales, mins, by_channel(packed.d)[:n], by_channel(packed.dmin)[:n], g, packed.supers,
                  packed.bits)


def quantize_4bit(weight: np.ndarray, group: int = 32, most_supers: int = 8) -> Blocks:
    """A float weight [n, k] in the Q4_K form (4-bit values, 6-bit scales and mins under a float per super-group):
    for a draft, whose values may change (the target still checks every token; only acceptance moves).
    Super-groups of up to most_supers groups, as many as divide k's groups (k need not be a multiple of 256)."""
    n, k = weight.shape
    if k % group:
        raise DraftwiseError(f"a 4-bit draft weight needs a width that is a multiple of {group}, not {k}")
    groups = k // group
    supers = max(s for s in range(1, most_supers + 1) if groups % s == 0)
    w = weight.astype(np.float32).reshape(n, groups, group)
    low = np.maximum(-w.min(axis=2), 0.0)  # [n, groups]: w >= -low
    step = (w.max(axis=2) + low) / 15  # [n, groups]: the 16 levels' spacing
    per_super = lambda a: a.reshape(n, groups // supers, supers)  # noqa: E731
    d = per_super(step).max(axis=2) / 63  # [n, super-groups]
    dmin = per_super(low).max(axis=2) / 63
    safe = lambda a: np.where(a > 0, a, 1.0)  # noqa: E731
    sc = np.clip(np.rint(per_super(step) / safe(d)[..., None]), 0, 63).reshape(n, groups)
    mn = np.clip(np.rint(per_super(low) / safe(dmin)[..., None]), 0, 63).reshape(n, groups)
    scale = np.repeat(d, supers, axis=1) * sc  # [n, groups]: what the kernel multiplies by
    offset = np.repeat(dmin, supers, axis=1) * mn
    q = np.clip(np.rint((w + offset[..., None]) / safe(scale)[..., None]), 0, 15)
    q = np.where(scale[..., None] > 0, q, 0).reshape(n, k)
    return Blocks(q.astype(np.uint8), sc.astype(np.int8), mn.astype(np.int8), d.astype(np.float32),
                  dmin.astype(np.float32), group, supers, 4)
