"""A GGUF file's quantized blocks, read as published into the layout qgemm.c multiplies by.

Every type read here maps exactly onto one form: w[n, k] = d[n, s] * sc[n, g] * q[n, k] - dmin[n, s] * mn[n, g],
q unsigned, g = k // group its group, s = g // supers its super-group (groups of `group` values, `supers` groups a
super-group). The integers and scales are the file's own; nothing is re-quantized from floats.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from draftwise.backends.huge_pages import on_huge_pages
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
    bits: int  # what every q fits in: 2, 4, 6 or 8 (how qgemm.c stores them)

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


def _q4_k_scales(blocks: np.ndarray):  # (sc, mn [blocks, 8], d, dmin [blocks, 1]) of Q4_K blocks
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    # the 12 bytes as three words a, b, c of 4 bytes (each byte's arithmetic on its own, four at a time)
    words = np.ascontiguousarray(blocks[:, 4:16]).view(np.uint32)  # [blocks, 3]
    a, b, c = words[:, 0:1], words[:, 1:2], words[:, 2:3]
    sc = np.concatenate([a & 0x3F3F3F3F, (c & 0x0F0F0F0F) | ((a >> 2) & 0x30303030)], axis=-1)  # [blocks, 2 words]
    mn = np.concatenate([b & 0x3F3F3F3F, ((c >> 4) & 0x0F0F0F0F) | ((b >> 2) & 0x30303030)], axis=-1)
    return sc.view(np.uint8), mn.view(np.uint8), d, dmin  # [blocks, 8] each


def _q4_k(blocks: np.ndarray):  # 144 bytes: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 of nibbles
    sc, mn, d, dmin = _q4_k_scales(blocks)
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

    def on_huge_pages(self) -> "Packed":
        """These blocks with their large arrays copied onto huge pages (huge_pages.py), as a load from the pack cache
        reads them: the same bytes, streamed faster by a step."""
        q, sc, d, dmin = (on_huge_pages(a) for a in (self.q, self.sc, self.d, self.dmin))
        mn = sc if self.mn is self.sc else on_huge_pages(self.mn)
        return replace(self, q=q, sc=sc, mn=mn, d=d, dmin=dmin)


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
    if blocks.bits == 2:  # registers i + b * quarter share bytes: bits 2b and 2b + 1
        quarter = g // 16
        q = sum(q[:, :, b * quarter:(b + 1) * quarter] << (2 * b) for b in range(4)).astype(np.uint8)
    elif blocks.bits < 8:  # registers i and i + half share bytes: low and high nibble
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


# Packing straight from the file's bytes (pack_raw): the kernel's bytes of a group of one channel are byte operations
# on the file's bytes of that group, for these types; others go through decode and pack, a slice of rows at a time.
CHUNK_BYTES = 1 << 20  # the file's bytes packed at a time: the temporaries of a slice stay in the CPU's caches


def _q4_k_bytes(blocks: np.ndarray) -> np.ndarray:
    """[blocks, 8 groups, 16]: a group's bytes as pack lays them, byte o = value o | value 16 + o << 4. The file holds
    groups 2c and 2c + 1 as the low and high nibbles of its 32 bytes of chunk c."""
    x = np.ascontiguousarray(blocks[:, 16:]).view(np.uint64).reshape(-1, 4, 2, 2)  # 8 bytes a word
    a, b = x[:, :, 0], x[:, :, 1]  # [blocks, chunk, 2 words]: bytes 0..15 and 16..31 of each chunk
    return np.stack(_nibble_pairs(a, b), axis=2).view(np.uint8).reshape(-1, 8, 16)


LOW = np.uint64(0x0F0F0F0F0F0F0F0F)


def _nibble_pairs(a: np.ndarray, b: np.ndarray):
    """(a's low nibbles | b's low nibbles << 4, a's high nibbles | b's high nibbles << 4), byte by byte, on uint64
    words of 8 bytes each."""
    return (a & LOW) | ((b & LOW) << np.uint64(4)), ((a >> np.uint64(4)) & LOW) | (b & ~LOW)


def _q6_k_bytes(blocks: np.ndarray) -> np.ndarray:
    """[blocks, 16 groups, 12]: each group of 16 values as pack lays a 6-bit group: 8 bytes of low nibbles (byte o =
    value o | value 8 + o << 4), then 4 bytes of 2-bit highs (byte i = sum of value 4b + i's high bits << 2b). In the
    file, value h*128 + j*32 + l (group h*8 + j*2 + l // 16) has its low nibble in byte h*64 + (j % 2)*32 + l of
    ql (the high nibble for j >= 2), its high bits at 2j of byte h*32 + l of qh."""
    x = np.ascontiguousarray(blocks[:, :128]).view(np.uint64).reshape(-1, 2, 2, 2, 2)  # [blocks, h, j % 2, l // 16,
    a, b = x[..., 0], x[..., 1]  # o // 8] words of 8 bytes
    low = np.stack(_nibble_pairs(a, b), axis=2).view(np.uint8)  # [blocks, h, j // 2, j % 2, l // 16, 8]
    words = np.ascontiguousarray(blocks[:, 128:192]).view(np.uint32).reshape(-1, 2, 2, 4)  # [blocks, h, l // 16, b]
    high = np.stack([sum(((words[..., b] >> (2 * j)) & 0x03030303) << (2 * b) for b in range(4))
                     for j in range(4)], axis=2)  # [blocks, h, j, l // 16] (4 bytes i each)
    return np.concatenate([low.reshape(-1, 2, 4, 2, 8), high.view(np.uint8).reshape(-1, 2, 4, 2, 4)],
                          axis=-1).reshape(-1, 16, 12)


def _q8_0_bytes(blocks: np.ndarray) -> np.ndarray:  # the int8 values + 128
    return (blocks[:, 2:34] ^ 0x80).reshape(-1, 1, 32)


def _q4_0_bytes(blocks: np.ndarray) -> np.ndarray:  # the file's own nibble order is pack's (value o | value 16 + o)
    return blocks[:, 2:18].reshape(-1, 1, 16)


def _q4_1_bytes(blocks: np.ndarray) -> np.ndarray:
    return blocks[:, 4:20].reshape(-1, 1, 16)


def _q6_k_raw_scales(blocks):
    sc, d = blocks[:, 192:208].copy().view(np.int8), _f16(blocks[:, 208:210])
    return sc, sc, d, 32 * d


def _q8_0_raw_scales(blocks):
    d = _f16(blocks[:, 0:2])
    return *_unit_scales(len(blocks)), d, 128 * d


def _q4_0_raw_scales(blocks):
    d = _f16(blocks[:, 0:2])
    return *_unit_scales(len(blocks)), d, 8 * d


def _q4_1_raw_scales(blocks):
    sc, _ = _unit_scales(len(blocks))
    return sc, -sc, _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])


# type -> (the kernel's bytes of each group, the group's scales as the decoder gives them)
RAW_PACKERS = {"Q4_K": (_q4_k_bytes, _q4_k_scales), "Q6_K": (_q6_k_bytes, _q6_k_raw_scales),
               "Q8_0": (_q8_0_bytes, _q8_0_raw_scales), "Q4_0": (_q4_0_bytes, _q4_0_raw_scales),
               "Q4_1": (_q4_1_bytes, _q4_1_raw_scales)}


def pack_raw(type_name: str, raw: np.ndarray, n: int, k: int, order: np.ndarray | None = None) -> Packed:
    """pack(decode(type_name, raw, n, k).rows(order)), the same bytes, made a slice of rows at a time straight from
    the file's bytes (no byte a value, no copy of the whole weight): what a load does for every weight of a file.
    order: the output channels' order (llama_order), or None for the file's."""
    if type_name not in DECODERS:
        raise DraftwiseError(f"the quant backend reads {', '.join(DECODERS)} weights, not {type_name}")
    size, values, decoder, bits = DECODERS[type_name]
    raw = raw.reshape(n, -1)  # [n, bytes a row]
    probe = decode(type_name, raw[:1], 1, k)  # (a row, for the type's group and super-group sizes)
    group, supers = probe.group, probe.supers
    groups, super_groups = k // group, k // (group * supers)
    per_group = group * bits // 8  # the kernel's bytes a group of one channel
    shared = probe.mn is probe.sc  # its minimum is its scale (Q6_K, Q8_0, ...): one array, as decode gives it

    def part(chunk: np.ndarray, rows: int):
        if type_name not in RAW_PACKERS:
            one = pack(decode(type_name, chunk, rows, k))
            return one.q, one.sc, one.mn, one.d, one.dmin
        blocks = np.ascontiguousarray(chunk, dtype=np.uint8).reshape(rows * (k // values), size)
        to_bytes, to_scales = RAW_PACKERS[type_name]
        qb = to_bytes(blocks).reshape(rows, groups, per_group)
        s, m, dd, dm = to_scales(blocks)
        return _tiles(qb, s.reshape(rows, groups), m.reshape(rows, groups), dd.reshape(rows, super_groups),
                      dm.reshape(rows, super_groups), shared)
    return _by_slices(raw, order, (n, k, group, supers, bits), shared, part)


def requantize_draft(type_name: str, raw: np.ndarray, n: int, k: int, order: np.ndarray | None = None,
                     bits: int = 4) -> Packed:
    """pack(quantize_draft(decode(type_name, raw, n, k).rows(order).dequantize(), bits)), a slice of rows at a time: a
    weight on blocks of fewer bits for a draft (a wider type's on 4 bits; any on 2), which then reads fewer bytes a
    forward (its values move: only acceptance can). quantize_draft works row by row, so slicing changes no byte; the
    float copy of a slice is the only one made (never of the weight, nor of the model)."""
    raw = raw.reshape(n, -1)  # [n, bytes a row]
    probe = quantize_draft(np.zeros((1, k), dtype=np.float32), bits)  # (the form's group and super-group sizes)

    def part(chunk: np.ndarray, rows: int):
        one = pack(quantize_draft(decode(type_name, chunk, rows, k).dequantize(), bits))
        return one.q, one.sc, one.mn, one.d, one.dmin
    return _by_slices(raw, order, (n, k, probe.group, probe.supers, bits), False, part)


def _by_slices(raw: np.ndarray, order: np.ndarray | None, sizes: tuple, shared: bool, part) -> Packed:
    """The Packed of sizes (n, k, group, supers, bits), filled a slice of whole tiles at a time: part(the slice's raw
    rows [rows, bytes a row], rows) -> its (q, sc, mn, d, dmin) in pack's layout (rows padded to a tile)."""
    n, k, group, supers, bits = sizes
    groups, super_groups = k // group, k // (group * supers)
    tiles, per_group = -(-n // TILE), group * bits // 8
    q = np.empty(tiles * TILE * groups * per_group, dtype=np.uint8)
    sc = np.empty(tiles * TILE * groups, dtype=np.int8)
    mn = sc if shared else np.empty_like(sc)
    d, dmin = (np.empty(tiles * TILE * super_groups, dtype=np.float32) for _ in range(2))
    step = max(TILE, CHUNK_BYTES // max(raw.shape[1], 1) // TILE * TILE)  # rows a slice, whole tiles
    for start in range(0, n, step):
        rows = min(step, n - start)
        chunk = raw[start:start + rows] if order is None else raw[order[start:start + rows]]
        pq, psc, pmn, pd, pdmin = part(chunk, rows)
        begin, end = start // TILE, -(-(start + rows) // TILE)  # tiles of this slice
        q[begin * TILE * groups * per_group:end * TILE * groups * per_group] = pq
        sc[begin * TILE * groups:end * TILE * groups] = psc
        if not shared:
            mn[begin * TILE * groups:end * TILE * groups] = pmn
        d[begin * TILE * super_groups:end * TILE * super_groups] = pd
        dmin[begin * TILE * super_groups:end * TILE * super_groups] = pdmin
    return Packed(q, sc, mn, d, dmin, n, k, group, supers, bits)


def _tiles(qb: np.ndarray, sc, mn, d, dmin, shared: bool):
    """A slice's per-channel arrays [rows, ...] in pack's tile-major layout (flat), rows padded to whole tiles with
    zeros as pack pads them."""
    rows = len(qb)
    padded = -rows % TILE
    if padded:
        pad = lambda a: np.pad(a, ((0, padded),) + ((0, 0),) * (a.ndim - 1))  # noqa: E731
        qb, sc, d, dmin = pad(qb), pad(sc), pad(d), pad(dmin)
        mn = sc if shared else pad(mn)
    tiles, groups = len(qb) // TILE, qb.shape[1]
    # [tiles, channel, groups, registers] -> [tiles, groups, registers, channel]: a register is 4 bytes of a channel
    words = np.ascontiguousarray(qb).view(np.uint32).reshape(tiles, TILE, groups, -1).transpose(0, 2, 3, 1)
    by_tile = lambda a: np.ascontiguousarray(a.reshape(tiles, TILE, -1).transpose(0, 2, 1)).ravel()  # noqa: E731
    scales = by_tile(sc.astype(np.int8))
    return (np.ascontiguousarray(words).view(np.uint8).ravel(), scales,
            scales if shared else by_tile(mn.astype(np.int8)), by_tile(d.astype(np.float32)),
            by_tile(dmin.astype(np.float32)))


def unpack(packed: Packed) -> Blocks:
    """The per-channel blocks of a packed weight: pack's inverse (its padded channels dropped)."""
    tiles, g = -(-packed.n // TILE), packed.group
    groups, half = packed.k // g, g // 8
    if packed.bits == 8:
        q = packed.q.reshape(tiles, groups, g // 4, TILE, 4)
    elif packed.bits == 2:
        planes = packed.q.reshape(tiles, groups, -1, TILE, 4)  # [tiles, groups, vec / 4, channel, 4]
        q = np.concatenate([(planes >> (2 * b)) & 0x03 for b in range(4)], axis=2)
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


DRAFT_BITS = (4, 2)  # the widths a draft's blocks may be re-quantized to


def check_draft_bits(bits: int) -> None:
    if bits not in DRAFT_BITS:
        raise DraftwiseError(f"a draft's blocks take {' or '.join(map(str, DRAFT_BITS))} bits, not {bits}")


def quantize_draft(weight: np.ndarray, bits: int = 4, group: int = 32, most_supers: int = 8) -> Blocks:
    """A float weight [n, k] in the Q4_K form (bits-bit values, 6-bit scales and mins under a float per super-group;
    at 4 bits Q4_K's own): for a draft, whose values may change (the target still checks every token; only acceptance
    moves). Super-groups of up to most_supers groups, as many as divide k's groups (k need not be a multiple of 256).
    At 2 bits the values take 2.5 bits a weight with their scales, not 4.5: a forward reads 45% fewer bytes."""
    check_draft_bits(bits)
    levels = (1 << bits) - 1
    n, k = weight.shape
    if k % group:
        raise DraftwiseError(f"a {bits}-bit draft weight needs a width that is a multiple of {group}, not {k}")
    groups = k // group
    supers = max(s for s in range(1, most_supers + 1) if groups % s == 0)
    w = weight.astype(np.float32).reshape(n, groups, group)
    low = np.maximum(-w.min(axis=2), 0.0)  # [n, groups]: w >= -low
    step = (w.max(axis=2) + low) / levels  # [n, groups]: the levels' spacing
    per_super = lambda a: a.reshape(n, groups // supers, supers)  # noqa: E731
    d = per_super(step).max(axis=2) / 63  # [n, super-groups]
    dmin = per_super(low).max(axis=2) / 63
    safe = lambda a: np.where(a > 0, a, 1.0)  # noqa: E731
    sc = np.clip(np.rint(per_super(step) / safe(d)[..., None]), 0, 63).reshape(n, groups)
    mn = np.clip(np.rint(per_super(low) / safe(dmin)[..., None]), 0, 63).reshape(n, groups)
    scale = np.repeat(d, supers, axis=1) * sc  # [n, groups]: what the kernel multiplies by
    offset = np.repeat(dmin, supers, axis=1) * mn
    q = np.clip(np.rint((w + offset[..., None]) / safe(scale)[..., None]), 0, levels)
    q = np.where(scale[..., None] > 0, q, 0).reshape(n, k)
    return Blocks(q.astype(np.uint8), sc.astype(np.int8), mn.astype(np.int8), d.astype(np.float32),
                  dmin.astype(np.float32), group, supers, bits)
