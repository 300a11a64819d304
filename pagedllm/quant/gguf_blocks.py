"""GGUF block types decoded from their bytes into ``QuantizedWeight`` s with exactly the file's numbers.

Every block type that the engine runs natively is one decoder here, registered by its GGUF type name (``DECODERS``):
it takes a tensor's rows of raw blocks (a uint8 view of the memory-mapped file, ``(rows, bytes per row)``) and
returns the codes, per-block scales and offsets that the block kernel (``qlinear``, ``quant/linear.py``) runs. No
value goes through a float32 weight: a sub-block's scale and offset are computed in float32 from the file's float16
super-block scale and its small integer sub-scale (``d * sc``, ``-dmin * mn``), products that float32 holds exactly,
so ``dequantize`` of the result equals ``gguf.quants.dequantize`` of the bytes bit for bit (``tests/kernels``).

The forms (``QuantizedWeight`` with ``offset_form``: w = c * scale + offset):
- 4-bit codes c in [0, 16) with an offset: Q4_0 (offset -8d), Q4_1, Q4_K (blocks of 32), Q2_K and Q3_K (2- and 3-bit
  codes, blocks of 16: Q3_K's signed values as c = q + 4 with offset -4 * scale);
- signed 8-bit codes: Q8_0, Q5_0 (q - 16), Q5_1 and Q5_K (q in [0, 32) with an offset), Q6_K (q - 32, blocks of 16),
  IQ4_NL and IQ4_XS (their 16-entry non-linear table of int8 values);
- 4-bit codes through a table (``QuantizedWeight.table``): MXFP4 (OCP microscaling, gpt-oss's experts: E2M1 values
  doubled to the integers 0, +-1, +-2, +-3, +-4, +-6, +-8, +-12, times half the block's power-of-two E8M0 scale, as
  ggml keeps them; stored as value + 16 with the offset -16 x scale).
Blocks of 16 (``group_size`` 16) run with a scale per half block of 32 in the kernel.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from pagedllm.gguf_file import BLOCK_TYPES
from pagedllm.kernels import cpu_ops
from pagedllm.quant.formats import KScales, QuantizedWeight, dequantize

QK = 256  # values per K-quant super-block


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 little-endian float16 bytes -> (...) float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _blocks(data: np.ndarray, nbytes: int) -> tuple[int, np.ndarray]:
    """(rows, (rows * blocks per row, nbytes)) of a tensor's raw rows."""
    rows = int(np.prod(data.shape[:-1]))
    return rows, np.ascontiguousarray(data).reshape(-1, nbytes)


def _nibbles(qs: np.ndarray, axis: int = 1) -> np.ndarray:
    """(n, ...) bytes -> their low nibbles, then their high nibbles, along a new axis ``axis`` (written in place:
    no stacked copy of two temporaries)."""
    out = np.empty(qs.shape[:axis] + (2,) + qs.shape[axis:], np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[(slice(None),) * axis + (0,)])
    np.right_shift(qs, 4, out=out[(slice(None),) * axis + (1,)])
    return out


def _bits(b: np.ndarray) -> np.ndarray:
    """(n, B) bytes -> (n, 8B) bits, little-endian (bit j of byte i is element 8i + j)."""
    return np.unpackbits(b, axis=-1, bitorder="little")


def _raw16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 float16 bytes -> (...) float16, as they are."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _weight(rows: int, codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None, bits: int,
            group: int, ks: tuple | None = None, stored: bool = False) -> QuantizedWeight:
    """A ``QuantizedWeight`` (rows, K) from flat per-block arrays; 8-bit ``codes`` are signed (stored + 128), or
    already stored (``stored``: the kernels' ``gguf_codes``).
    ``ks``: a K-quant's (super_d, sub_d, super_m, sub_m) per super-block (float16 (n,), int8 (n, subs)), with
    scales == super_d * sub_d and offsets == super_m * sub_m."""
    c = codes.reshape(rows, -1)
    if isinstance(c, torch.Tensor):  # deferred codes (``RawCodes``): their shape only, on the meta device
        codes_t = c
    else:
        if bits == 8 and not stored:
            c = c.view(np.uint8) ^ np.uint8(0x80)  # s + 128 as a byte: its sign bit flipped
        codes_t = torch.from_numpy(np.ascontiguousarray(c, dtype=np.uint8))
    t = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(rows, -1))
    kscales = None
    if ks is not None:
        r = lambda a, dt: None if a is None else torch.from_numpy(  # noqa: E731
            np.ascontiguousarray(a, dtype=dt).reshape(rows, -1))
        kscales = KScales(r(ks[0], np.float16), r(ks[1], np.int8), r(ks[2], np.float16), r(ks[3], np.int8))
    return QuantizedWeight(codes_t, t(scales), t(offsets), bits, group, offset_form=offsets is not None,
                           kscales=kscales)


# The types whose codes the kernels decode in one pass (``gguf_codes``: what a start-up spends most on, a byte per
# weight): those with a C++ decoder in ``gguf_file.BLOCK_TYPES``. Their decoders take those codes as ``codes`` (the
# rows' stored codes, 8-bit ones + 128) and compute only the scales; without the kernels, numpy's steps below give
# the same codes.
FAST_CODES = frozenset(t.name for t in BLOCK_TYPES.values() if t.decoder)
PLAIN_CODES = (0, 0, 0, 0)  # ``pack_parts``'s type of rows that are codes already (one byte per weight)


class RawCodes:
    """A GGUF tensor's codes left in its raw blocks (``data``: its rows of the memory map) until something reads
    them: the block kernel's packing (``pack_parts``) decodes them 8 rows at a time, so a start-up writes no array of
    a byte per weight; ``tensor()`` decodes them all for any other consumer (``QuantizedWeight.materialized``).
    ``widen``: 4-bit codes c read as 8-bit ones (stored c + 128), in a fused layer of 8-bit codes. ``release``: drops
    the rows' pages of the map from the resident set once packed (they stay readable)."""

    def __init__(self, data: np.ndarray, kind: str, widen: bool = False, release=None) -> None:
        t = BLOCK_TYPES[kind]
        self.data, self.kind, self.widen, self.release = data, kind, widen, release
        self.shape = (data.shape[0], data.shape[1] // t.nbytes * t.values)

    def widened(self) -> "RawCodes":
        return RawCodes(self.data, self.kind, True, self.release)

    def rows(self, n: int) -> "RawCodes":
        return RawCodes(self.data[:n], self.kind, self.widen)

    def source(self) -> tuple:
        """``pack_parts``'s description of these rows; with a ``release`` they are a file's mapped pages, which it
        drops from the resident set as it passes them (the start's peak memory)."""
        return self.data, BLOCK_TYPES[self.kind].kernel_type(), self.shape[0], self.widen, self.release is not None

    def tensor(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=torch.uint8)
        cpu_ops().gguf_codes(self.data, BLOCK_TYPES[self.kind].kernel_type(), out)
        if self.widen:
            out |= 0x80
        if self.release is not None:
            self.release()  # decoded: the file's pages need not stay resident (they stay readable)
        return out


def q4_0(data: np.ndarray, codes: np.ndarray | None = None) -> QuantizedWeight:
    rows, b = _blocks(data, 18)
    d = _f16(b[:, 0:2])
    return _weight(rows, _nibbles(b[:, 2:]) if codes is None else codes, d, -8 * d, 4, 32)


def q4_1(data: np.ndarray, codes: np.ndarray | None = None) -> QuantizedWeight:
    rows, b = _blocks(data, 20)
    return _weight(rows, _nibbles(b[:, 4:]) if codes is None else codes, _f16(b[:, 0:2]), _f16(b[:, 2:4]), 4, 32)


def q8_0(data: np.ndarray, codes: np.ndarray | None = None) -> QuantizedWeight:
    rows, b = _blocks(data, 34)
    return _weight(rows, b[:, 2:].view(np.int8) if codes is None else codes, _f16(b[:, 0:2]), None, 8, 32,
                   stored=codes is not None)


def _q5_values(b: np.ndarray, qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes in [0, 32): low nibbles from qs (elements 0-15 low, 16-31 high), bit 4 from qh."""
    return (_nibbles(qs).reshape(len(b), 32) | (_bits(qh) << 4)).astype(np.int8)


def q5_0(data: np.ndarray, codes: np.ndarray | None = None) -> QuantizedWeight:
    rows, b = _blocks(data, 22)
    stored = codes is not None
    if codes is None:
        codes = _q5_values(b, b[:, 2:6], b[:, 6:]) - 16
    return _weight(rows, codes, _f16(b[:, 0:2]), None, 8, 32, stored=stored)


def q5_1(data: np.ndarray) -> QuantizedWeight:
    rows, b = _blocks(data, 24)
    return _weight(rows, _q5_values(b, b[:, 4:8], b[:, 8:]), _f16(b[:, 0:2]), _f16(b[:, 2:4]), 8, 32)


def _k_scale_min(b: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K blocks' 12 bytes of eight 6-bit scales and eight 6-bit mins -> (n, 8) each."""
    ops = cpu_ops()
    if ops is not None:
        both = ops.gguf_k_scales(b, BLOCK_TYPES[kind].nbytes).numpy()
        return both[:, :8].astype(np.float32), both[:, 8:].astype(np.float32)
    s = b[:, 4:16]
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def q4_k(data: np.ndarray, codes: np.ndarray | None = None) -> QuantizedWeight:
    rows, b = _blocks(data, 144)
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, mn = _k_scale_min(b, "Q4_K")
    if codes is None:
        codes = _nibbles(b[:, 16:].reshape(-1, 4, 32), axis=2)  # (n, 4, 2, 32)
    return _weight(rows, codes, d * sc, -(dmin * mn), 4, 32, (_raw16(b[:, 0:2]), sc, _raw16(b[:, 2:4]), -mn))


def q5_k(data: np.ndarray, codes: np.ndarray | None = None) -> QuantizedWeight:
    rows, b = _blocks(data, 176)
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, mn = _k_scale_min(b, "Q5_K")
    stored = codes is not None
    if codes is None:
        qh, qs = b[:, 16:48], b[:, 48:].reshape(-1, 4, 32)
        low = _nibbles(qs, axis=2).reshape(-1, 8, 32)
        high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # (n, 8, 32): bit i of block i
        codes = low | (high << 4)
    return _weight(rows, codes if stored else codes.view(np.int8), d * sc, -(dmin * mn), 8, 32,
                   (_raw16(b[:, 0:2]), sc, _raw16(b[:, 2:4]), -mn), stored=stored)


def q6_k(data: np.ndarray, codes: np.ndarray | None = None) -> QuantizedWeight:
    rows, b = _blocks(data, 210)
    ql, qh, sc, d = b[:, 0:128], b[:, 128:192], b[:, 192:208].view(np.int8), _f16(b[:, 208:210])
    q = codes
    if q is None:
        q = _nibbles(ql.reshape(-1, 2, 64), axis=2).reshape(-1, 8, 32)  # the low 4 bits
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
        q |= high.reshape(-1, 8, 32) << 4
        q = q.view(np.int8)
        q -= 32
    return _weight(rows, q, d[:, None] * sc.astype(np.float32), None, 8, 16, (_raw16(b[:, 208:210]), sc, None, None),
                   stored=codes is not None)


def q2_k(data: np.ndarray) -> QuantizedWeight:
    rows, b = _blocks(data, 84)
    s, qs, d, dmin = b[:, 0:16], b[:, 16:80], _f16(b[:, 80:82])[:, None], _f16(b[:, 82:84])[:, None]
    q = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    return _weight(rows, q, d * (s & 0x0F).astype(np.float32), -(dmin * (s >> 4).astype(np.float32)), 4, 16,
                   (_raw16(b[:, 80:82]), s & 0x0F, _raw16(b[:, 82:84]), -(s >> 4).astype(np.int8)))


def q3_k(data: np.ndarray) -> QuantizedWeight:
    rows, b = _blocks(data, 110)
    hmask, qs, s, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])[:, None]
    low = np.stack([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1).reshape(-1, 16)
    high = (s[:, 8:12][:, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]) & 3  # (n, 4, 4)
    sub = (low | (high.reshape(-1, 16) << 4)).astype(np.int8) - 32  # (n, 16) in [-32, 32)
    scale = d * sub.astype(np.float32)
    ql = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    qh = (hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # (n, 8, 32)
    # value ql - 4 (high bit clear) or ql (set): the code ql + 4 * bit, offset -4 * scale
    # the offset -4 * scale as (-d) * (4 * sub): both products exact, so the same float32 value
    return _weight(rows, ql.reshape(-1, 256) + 4 * qh.reshape(-1, 256), scale, -4 * scale, 4, 16,
                   (_raw16(b[:, 108:110]), sub, -_raw16(b[:, 108:110]), 4 * sub))


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def iq4_nl(data: np.ndarray) -> QuantizedWeight:
    rows, b = _blocks(data, 18)
    return _weight(rows, IQ4_VALUES[_nibbles(b[:, 2:])], _f16(b[:, 0:2]), None, 8, 32)


def iq4_xs(data: np.ndarray) -> QuantizedWeight:
    rows, b = _blocks(data, 136)
    d, sh, sl, qs = _f16(b[:, 0:2])[:, None], b[:, 2:4].copy().view(np.uint16)[:, 0], b[:, 4:8], b[:, 8:]
    low = np.stack([sl & 0x0F, sl >> 4], axis=2).reshape(-1, 8)
    high = (sh[:, None] >> (2 * np.arange(8, dtype=np.uint16))[None, :]) & 3
    sub = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - 32
    scale = d * sub.astype(np.float32)
    q = qs.reshape(-1, 8, 16)
    return _weight(rows, IQ4_VALUES[np.stack([q & 0x0F, q >> 4], axis=2)], scale, None, 8, 32,
                   (_raw16(b[:, 0:2]), sub, None, None))


MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)  # E2M1 x 2
# MXFP4's codes as 4-bit codes through a table (``QuantizedWeight.table``): value + 16 (4 .. 28: non-negative and small,
# as the block kernels' unsigned 4-bit paths take them) with the offset -16 * scale; both products are exact
MXFP4_SHIFT = 16
MXFP4_MAX_E8M0 = 250  # 28 * 2^(250 - 128) < 2^127: every (value + 16) * scale is a finite float32
MXFP4_TABLE = torch.from_numpy((MXFP4_VALUES.astype(np.int16) + MXFP4_SHIFT).astype(np.uint8))


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """Half of an E8M0 scale's value, 2 ** (e - 128), as float32 bits (ggml's ``ggml_e8m0_to_fp32_half``): exact, the
    two smallest as subnormals."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


def _mxfp4_weight(rows: int, codes: np.ndarray, e: np.ndarray) -> QuantizedWeight:
    """MXFP4 codes (E2M1 indices, in element order) and E8M0 scales as 4-bit codes through ``MXFP4_TABLE``: half the
    scale, offset -16 times it."""
    if e.size and int(e.max()) > MXFP4_MAX_E8M0:
        raise ValueError(f"MXFP4 block scale 2^{int(e.max()) - 127} is out of range: (value + 16) * scale "
                         f"would overflow float32 (scales up to 2^{MXFP4_MAX_E8M0 - 127} are read)")
    d = e8m0_half(e)
    return dataclasses.replace(_weight(rows, codes, d, -MXFP4_SHIFT * d, 4, 32), table=MXFP4_TABLE)


def mxfp4_ocp(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """An HF checkpoint's MXFP4 weight (transformers' layout: ``blocks`` (rows, K/32, 16) uint8, a byte's low nibble
    the even element and its high nibble the odd one; ``scales`` (rows, K/32) uint8 E8M0) as ``mxfp4`` gives a GGUF
    file's: the same codes (E2M1 indices), scales and table."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 16).numpy()
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(rows, -1)  # elements 2j, 2j + 1
    return _mxfp4_weight(rows, codes, scales.reshape(rows, -1).numpy())


def mxfp4(data: np.ndarray) -> QuantizedWeight:
    """4-bit codes (the file's nibbles) through ``MXFP4_TABLE``, half the E8M0 scale, offset -16 times it: half a
    byte per weight in the kernels, as in the file."""
    rows, b = _blocks(data, 17)
    return _mxfp4_weight(rows, _nibbles(b[:, 1:]), b[:, 0])


# GGUF type name -> decoder of a tensor's raw block rows
DECODERS: dict[str, Callable[[np.ndarray], QuantizedWeight]] = {
    "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1, "Q8_0": q8_0,
    "Q2_K": q2_k, "Q3_K": q3_k, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k,
    "IQ4_NL": iq4_nl, "IQ4_XS": iq4_xs, "MXFP4": mxfp4,
}


CHUNK_ROWS = 8192  # rows decoded at a time: the decoders' temporaries stay a few MiB, not a few per weight


def decode(data: np.ndarray, kind: str, defer: bool = False, release=None) -> QuantizedWeight:
    """The tensor's blocks as a ``QuantizedWeight`` (``kind``: a key of ``DECODERS``), decoded in chunks of rows
    into the result's own arrays (a large embedding's temporaries would otherwise be several times its size). The
    codes of ``FAST_CODES`` types come from the kernels in one pass over the whole tensor, straight into the
    result, or with ``defer`` are left in the blocks (``RawCodes``, with ``release`` for after they are packed).
    ``release(lo, hi)`` (a mapped file's tensor) drops each chunk's pages, bytes [lo, hi), once it is decoded:
    about one chunk of the file is resident at a time (the 1.5B's LM head held all its 191 MB at the start's peak)."""
    data = data.reshape(-1, data.shape[-1])
    rows = len(data)
    ops = cpu_ops() if kind in FAST_CODES else None
    codes = given = raw = None
    if ops is not None:
        data = np.ascontiguousarray(data)
        if defer:
            raw = RawCodes(data, kind, release=release)
            codes = given = torch.empty(raw.shape, dtype=torch.uint8, device="meta")
        else:
            codes = RawCodes(data, kind).tensor()
            given = codes.numpy()
    row_bytes = data.shape[1]

    def chunk(r: int) -> QuantizedWeight:
        part = DECODERS[kind](data[r:r + CHUNK_ROWS], codes=given[r:r + CHUNK_ROWS]) if (
            given is not None) else DECODERS[kind](data[r:r + CHUNK_ROWS])
        if release is not None:  # these rows' file pages: read (scales sit beside codes), not needed now
            release(r * row_bytes, (r + CHUNK_ROWS) * row_bytes)
        return part

    if rows <= CHUNK_ROWS:
        qw = chunk(0)
        return qw if raw is None else _deferred(qw, raw)
    first = chunk(0)
    empty = lambda t: None if t is None else t.new_empty(rows, t.shape[1])  # noqa: E731
    out = QuantizedWeight(codes if codes is not None else empty(first.codes), empty(first.scales),
                          empty(first.zeros), first.bits, first.group_size, offset_form=first.offset_form,
                          kscales=None if first.kscales is None else first.kscales.map(empty), table=first.table)
    for r in range(0, rows, CHUNK_ROWS):
        part = first if r == 0 else chunk(r)
        if codes is None:
            out.codes[r:r + CHUNK_ROWS] = part.codes
        out.scales[r:r + CHUNK_ROWS] = part.scales
        if out.zeros is not None:
            out.zeros[r:r + CHUNK_ROWS] = part.zeros
        if out.kscales is not None:
            for dst, src in zip(_fields(out.kscales), _fields(part.kscales)):
                if dst is not None:
                    dst[r:r + CHUNK_ROWS] = src
    return out if raw is None else _deferred(out, raw)


def _deferred(qw: QuantizedWeight, raw: "RawCodes") -> QuantizedWeight:
    """``qw`` with its codes left in the file's blocks (``raw``). Reading the scales touched every page of the
    blocks (a Q6_K or Q4_K block holds its scales beside its codes), each chunk's dropped as ``decode`` passed it
    (the chunks' ranges, widened to whole pages, cover the tensor); the packing reads them back from the page cache,
    dropping them again as it passes (``pack_parts``), so a large tensor's file pages are not resident beside its
    packed copy."""
    return dataclasses.replace(qw, code_parts=(raw,))


def _fields(k: KScales) -> tuple:
    return k.super_d, k.sub_d, k.super_m, k.sub_m


# block types that decode to 4-bit codes (the others: signed 8-bit), and those with a scale per 16 values
# the table's columns as sets (``gguf_file.BLOCK_TYPES``); K-scaled: the decoders keep the file's two-level scales
# (``QuantizedWeight.kscales``: a float16 scale per super-block of 256 and small integer ones per sub-block), which
# llama.cpp multiplies with 8-bit activations
FOUR_BIT = frozenset(t.name for t in BLOCK_TYPES.values() if t.code_bits == 4)
GROUP_16 = frozenset(t.name for t in BLOCK_TYPES.values() if t.group == 16)
K_SCALED = frozenset(t.name for t in BLOCK_TYPES.values() if t.k_scaled)


def k_scaled(w) -> bool:
    """Whether a stored weight (decoded, or ``LazyBlocks`` not yet) carries K-quant two-level scales."""
    return w.kind in K_SCALED if isinstance(w, LazyBlocks) else getattr(w, "kscales", None) is not None


class LazyBlocks:
    """A tensor's blocks, decoded when first needed (``LazyWeights``): its shape, bits and group size are known
    without decoding. ``post``: applied to the decoded weight (e.g. a row permutation)."""

    def __init__(self, data: np.ndarray, kind: str, shape: tuple[int, int], post=None, release=None) -> None:
        self.data, self.kind, self.shape, self.post, self.release = data, kind, shape, post, release
        self.bits = 4 if kind in FOUR_BIT else 8
        self.group_size = 16 if kind in GROUP_16 else 32

    def load(self) -> QuantizedWeight:
        if self.post is None and self.kind in FAST_CODES and cpu_ops() is not None:
            # the codes stay in the file's blocks until the block kernel packs them (then their pages are released)
            return decode(self.data, self.kind, defer=True, release=self.release)
        qw = decode(self.data, self.kind, release=self.release)  # (which drops the file's pages chunk by chunk)
        return qw if self.post is None else self.post(qw)


class BlockRows:
    """An embedding table that is only looked up (a GGUF file's ``token_embd`` beside its own ``output`` head): its
    blocks stay in the file's memory map and each step decodes the rows it looks up, as llama.cpp's get_rows reads
    its mapped file. The table then holds no resident copy (the packed one cost the 1.5B 117 MiB, the 0.5B 137
    MiB), and the file's pages of rows never looked up are never read. The rows are bitwise those of the packed table (``BlockQuantLinear.embedding``: the same float32
    steps of codes, scales and offsets)."""

    kind = "gguf-rows"

    def __init__(self, lazy: LazyBlocks, dtype: torch.dtype) -> None:
        self.data, self.block_kind, self.out_dtype = lazy.data.reshape(-1, lazy.data.shape[-1]), lazy.kind, dtype
        self.out_features, self.in_features = lazy.shape
        self.bits = lazy.bits

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.data[ids.reshape(-1).numpy()]  # the looked-up rows' blocks (a copy of a few KiB each)
        return dequantize(decode(rows, self.block_kind)).reshape(*ids.shape, self.in_features).to(self.out_dtype)

    def tensors(self) -> list:
        return []  # the file's pages, not the process's memory

    _tensors = tensors


class LazyWeights(dict):
    """A weights dict whose ``LazyBlocks`` values decode when read (``pop``, ``[]``, ``get``), so a model that
    builds its layers one by one holds the decoded (one byte per weight) form of a few tensors at a time, not of
    all of them. Reading a value starts decoding the next ``ahead`` lazy values (in insertion order) on a thread
    pool, so decoding runs beside the layer packing instead of before it. ``peek``: a value without decoding it."""

    def __init__(self, items, ahead: int = 3, workers: int = 2) -> None:
        super().__init__(items)
        self._order = [k for k, v in self.items() if isinstance(v, LazyBlocks)]
        self._next = 0
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._ahead = ahead
        self._pool = ThreadPoolExecutor(workers) if ahead > 0 else None

    def peek(self, key, default=None):
        return dict.get(self, key, default)

    def _resolve(self, key) -> None:
        v = dict.get(self, key)
        if not isinstance(v, LazyBlocks):
            return
        with self._lock:
            fut = self._futures.pop(key, None)
        value = fut.result() if fut is not None else v.load()
        dict.__setitem__(self, key, value)
        self._prefetch()

    def _prefetch(self) -> None:
        if self._pool is None:
            return
        with self._lock:
            while len(self._futures) < self._ahead and self._next < len(self._order):
                key = self._order[self._next]
                self._next += 1
                v = dict.get(self, key)
                if isinstance(v, LazyBlocks) and key not in self._futures:
                    self._futures[key] = self._pool.submit(v.load)
            if self._next >= len(self._order) and not self._futures:
                self._pool.shutdown(wait=False)
                self._pool = None

    def __getitem__(self, key):
        self._resolve(key)
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        if key in self:
            return self[key]
        return default

    def pop(self, key, *default):
        if key in self:
            self._resolve(key)
        return dict.pop(self, key, *default)

    def pop_blocks(self, key) -> LazyBlocks | None:
        """The value as its ``LazyBlocks`` (popped), not decoded, or None (left in place) where it is not one. A
        decode already started ahead for it is waited for and dropped."""
        v = dict.get(self, key)
        if not isinstance(v, LazyBlocks):
            return None
        with self._lock:
            fut = self._futures.pop(key, None)
        if fut is not None and not fut.cancel():
            fut.result()  # (its pages were released; the result is not kept)
        dict.pop(self, key)
        return v
