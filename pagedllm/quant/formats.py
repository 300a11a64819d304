"""Quantized weight formats and round-to-nearest quantization (pure tensor math, any device).

Integer weights are group-wise along the input dimension: a weight (N, K) with group size G has N x K/G groups,
each with its own scale (and, when asymmetric, its own zero). Codes are unsigned, ``0 .. 2**bits - 1``, and decode
as ``w = (q - 2**(bits-1)) * scale + zero`` — the convention of torch's packed int4 matmul, so codes, scales and
zeros go to the kernels unchanged. Symmetric weights have no zero. Round-to-nearest error is at most scale/2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8 e4m3 value


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # (N, K) uint8 in [0, 2**bits)
    scales: torch.Tensor  # (N, K // group_size) float32
    zeros: torch.Tensor | None  # (N, K // group_size) float32, None when symmetric
    bits: int
    group_size: int
    input_scale: torch.Tensor | None = None  # (K,) AWQ: the layer computes (x / input_scale) @ W'^T
    # GGUF's form: ``zeros`` holds the offset m of w = c * scale + m, with c the code itself for 4-bit codes (8-bit:
    # c = q - 128, as without the flag), so a file's offsets are kept as they are (no m + 8 * scale round trip)
    offset_form: bool = False
    # GGUF K-quants' own scales, when the weight came from such a file: scales == super_d * sub_d and zeros ==
    # super_m * sub_m (exact float32 products), which the block kernel keeps at 1 byte per sub-block instead of 4
    kscales: "KScales | None" = None
    # codes not yet in one array: ``codes`` is then a tensor on the meta device (its shape only: reading it raises)
    # and ``code_parts`` holds them, rows in order, each a uint8 code tensor or a source that decodes on demand (a
    # GGUF tensor's raw blocks: ``quant.gguf_blocks.RawCodes``, with ``tensor()``, ``widened()``, ``rows(n)``). The
    # block kernel packs the parts as they are (a fused layer without a concatenated copy, a GGUF tensor without an
    # array of a byte per weight); ``materialized()`` gives any other consumer the codes in one tensor
    code_parts: tuple | None = None
    # 4-bit codes in offset form that stand for other values (MXFP4's E2M1 values): uint8 (16,), each below 128;
    # w = table[c] * scale + zeros. None: the codes are their values
    table: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.table is not None and (self.bits != 4 or not self.offset_form or self.table.shape != (16,)
                                       or self.table.dtype != torch.uint8 or int(self.table.max()) >= 128):
            raise ValueError("a code table is 16 uint8 values below 128, for 4-bit codes in offset form")
        if k % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide in_features {k}")
        if tuple(self.scales.shape) != (n, k // self.group_size):
            raise ValueError(f"scales shape {tuple(self.scales.shape)} != {(n, k // self.group_size)}")
        if self.offset_form and self.zeros is None:
            raise ValueError("offset_form needs the offsets (zeros)")

    @property
    def code_mid(self) -> int:
        """What comes off a code before it is scaled: 2**(bits-1), or 0 for 4-bit codes in offset form."""
        return 0 if self.offset_form and self.bits == 4 else 2 ** (self.bits - 1)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def materialized(self) -> "QuantizedWeight":
        """This weight with its codes in one tensor (concatenated from ``code_parts`` where deferred)."""
        if self.code_parts is None:
            return self
        codes = [c if isinstance(c, torch.Tensor) else c.tensor() for c in self.code_parts]
        return dataclasses.replace(self, codes=codes[0] if len(codes) == 1 else torch.cat(codes), code_parts=None)


@dataclass
class KScales:
    """A K-quant weight's scales as its file has them: float16 per super-block of 256 inputs (``super_d``,
    ``super_m``: (N, K/256)) times small integers per group (``sub_d``, ``sub_m``: (N, K/group) int8); no offsets:
    ``super_m`` and ``sub_m`` None."""

    super_d: torch.Tensor
    sub_d: torch.Tensor
    super_m: torch.Tensor | None = None
    sub_m: torch.Tensor | None = None

    def map(self, fn) -> "KScales":
        """The same with ``fn`` applied to each tensor (a row permutation, a slice, a repeat)."""
        return KScales(fn(self.super_d), fn(self.sub_d), None if self.super_m is None else fn(self.super_m),
                       None if self.sub_m is None else fn(self.sub_m))


@dataclass
class Fp8Weight:
    data: torch.Tensor  # (N, K) float8_e4m3fn
    scales: torch.Tensor  # (N,) float32: w = data * scale

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> QuantizedWeight:
    """Round-to-nearest group-wise quantization of ``w`` (N, K)."""
    n, k = w.shape
    if group_size <= 0:
        group_size = k
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide in_features {k}")
    scales, zeros = group_params(w, bits, group_size, symmetric)
    return QuantizedWeight(encode(w, scales, zeros, bits), scales, zeros, bits, group_size)


def group_params(w: torch.Tensor, bits: int, group_size: int, symmetric: bool):
    """Scales (and zeros) for each (row, group) of ``w`` from its range."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        scales = (g.abs().amax(-1) / (2 ** (bits - 1) - 1)).clamp_min(1e-10)
        return scales, None
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / (2 ** bits - 1)).clamp_min(1e-10)
    return scales, lo + scales * 2 ** (bits - 1)


def float16_blocks(qw: QuantizedWeight) -> QuantizedWeight:
    """``qw`` (4-bit, asymmetric) in GGUF Q4_1's precision: each group's scale d and offset m (w = d q + m for
    codes q) rounded to float16, the codes kept."""
    if qw.bits != 4 or qw.zeros is None:
        raise ValueError("float16_blocks takes 4-bit asymmetric weights")
    qw = qw.materialized()
    d = qw.scales.half().float()
    m = (qw.zeros - 8 * qw.scales).half().float()
    return QuantizedWeight(qw.codes, d, m + 8 * d, 4, qw.group_size, qw.input_scale)


def encode(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Codes of ``w`` for given group scales/zeros (groups inferred from the scales' shape)."""
    n, k = w.shape
    ng = scales.shape[1]
    g = w.float().reshape(n, ng, k // ng)
    mid = 2 ** (bits - 1)
    z = 0.0 if zeros is None else zeros.unsqueeze(-1)
    q = torch.round((g - z) / scales.unsqueeze(-1)) + mid
    return q.clamp_(0, 2 ** bits - 1).to(torch.uint8).reshape(n, k)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The effective full-precision weight, input scaling (AWQ) folded back in."""
    qw = qw.materialized()
    n, k = qw.codes.shape
    ng = k // qw.group_size
    codes = qw.codes if qw.table is None else qw.table[qw.codes.long()]
    q = codes.reshape(n, ng, qw.group_size).float() - qw.code_mid
    w = q * qw.scales.float().unsqueeze(-1)
    if qw.zeros is not None:
        w = w + qw.zeros.float().unsqueeze(-1)
    w = w.reshape(n, k)
    if qw.input_scale is not None:
        w = w / qw.input_scale.float()
    return w.to(dtype)


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    scales = (w.float().abs().amax(1) / FP8_MAX).clamp_min(1e-12)
    data = (w.float() / scales.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(data, scales)


def dequantize_fp8(fw: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (fw.data.float() * fw.scales.unsqueeze(1)).to(dtype)


def concat(parts: list, defer_codes: bool = False) -> QuantizedWeight | Fp8Weight:
    """Stack quantized weights along the output dimension (fusing q/k/v or gate/up). ``defer_codes``: the codes
    stay in the parts (``code_parts``; a block kernel packs them straight from there)."""
    if len(parts) == 1:
        return parts[0]
    p0 = parts[0]
    if isinstance(p0, Fp8Weight):
        return Fp8Weight(torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]))
    if any(p.input_scale is not None for p in parts):
        if any((p.bits, p.group_size, p.symmetric, p.input_scale is None) !=
               (p0.bits, p0.group_size, p0.symmetric, p0.input_scale is None) for p in parts):
            raise ValueError("fused weights with input scales must share bits, group size and symmetry")
    else:  # a GGUF file mixes block types in one fused layer (Q4_K q/k with a Q6_K v): widen them, exactly
        parts = _common_form(parts)
    p0 = parts[0]
    ks = None
    if all(p.kscales is not None for p in parts) and len({p.kscales.sub_m is None for p in parts}) == 1:
        cat = lambda f: torch.cat([f(p.kscales) for p in parts])  # noqa: E731
        k0 = p0.kscales
        ks = KScales(cat(lambda k: k.super_d), cat(lambda k: k.sub_d),
                     None if k0.super_m is None else cat(lambda k: k.super_m),
                     None if k0.sub_m is None else cat(lambda k: k.sub_m))
    code_parts = None
    if defer_codes:
        code_parts = tuple(c for p in parts for c in (p.code_parts if p.code_parts is not None else (p.codes,)))
        codes = torch.empty(sum(p.shape[0] for p in parts), p0.shape[1], dtype=torch.uint8, device="meta")
    else:
        codes = torch.cat([p.materialized().codes for p in parts])
    return QuantizedWeight(
        codes, torch.cat([p.scales for p in parts]),
        None if p0.zeros is None else torch.cat([p.zeros for p in parts]), p0.bits, p0.group_size,
        p0.input_scale, p0.offset_form, ks, code_parts, p0.table,
    )


def _common_form(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """``parts`` in one form that holds each exactly: the most bits, the smallest group, offsets where any has them.
    4-bit codes become the signed 8-bit codes of the same values; a group's scale is repeated over its halves."""
    bits = max(p.bits for p in parts)
    tables = {None if p.table is None else tuple(p.table.tolist()) for p in parts}
    if len(tables) > 1:  # codes of other values (or none) side by side: 8-bit codes hold each table's values
        bits = 8
    group = min(p.group_size for p in parts)
    with_zeros = any(p.zeros is not None for p in parts)
    if all((p.bits, p.group_size, p.zeros is not None) == (bits, group, with_zeros) for p in parts):
        if bits == 4 and len({p.offset_form for p in parts}) > 1:
            return [to_offset_form(p) for p in parts]
        return parts
    out = []
    for p in parts:
        if p.group_size % group:
            raise ValueError(f"group sizes {p.group_size} and {group} do not nest")
        rep = p.group_size // group
        codes, zeros, offset_form, code_parts = p.codes, p.zeros, p.offset_form, p.code_parts
        if p.bits != bits:  # 4 -> 8: the signed code c = q - code_mid, stored as c + 128; zeros/offsets unchanged
            if p.table is not None:  # the code's value, table[q] (offset form: code_mid 0), from the codes read whole
                codes = (p.table[p.materialized().codes.long()].to(torch.int16) + 128).to(torch.uint8)
                code_parts = None
            else:
                widen = lambda c: (c.to(torch.int16) - p.code_mid + 128).to(torch.uint8)  # noqa: E731
                if code_parts is not None and p.code_mid == 0:  # deferred codes c: c + 128 when read
                    code_parts = tuple(widen(c) if isinstance(c, torch.Tensor) else c.widened() for c in code_parts)
                else:
                    codes, code_parts = widen(p.materialized().codes), None
            offset_form = False  # 8-bit zeros are offsets already
        if with_zeros and zeros is None:
            zeros = torch.zeros_like(p.scales, dtype=torch.float32)
        if bits == 4 and with_zeros and not offset_form:
            p2 = to_offset_form(QuantizedWeight(codes, p.scales, zeros, 4, p.group_size))
            zeros, offset_form = p2.zeros, True
        scales = p.scales.repeat_interleave(rep, dim=1) if rep > 1 else p.scales
        if zeros is not None and rep > 1:
            zeros = zeros.repeat_interleave(rep, dim=1)
        ks = p.kscales
        if ks is not None:
            if rep > 1:
                ks = KScales(ks.super_d, ks.sub_d.repeat_interleave(rep, dim=1), ks.super_m,
                             None if ks.sub_m is None else ks.sub_m.repeat_interleave(rep, dim=1))
            if with_zeros and ks.sub_m is None:  # zero offsets: 0 * 0
                ks = KScales(ks.super_d, ks.sub_d, torch.zeros_like(ks.super_d), torch.zeros_like(ks.sub_d))
        out.append(QuantizedWeight(codes, scales, zeros, bits, group, None, offset_form and bits == 4, ks, code_parts,
                                   p.table if bits == 4 else None))
    if bits == 4 and len({p.offset_form for p in out}) > 1:
        out = [to_offset_form(p) for p in out]
    return out


def to_offset_form(qw: QuantizedWeight) -> QuantizedWeight:
    """``qw`` with offsets m of w = c * scale + m (see ``offset_form``): the same codes and scales."""
    if qw.offset_form:
        return qw
    zeros = torch.zeros_like(qw.scales, dtype=torch.float32) if qw.zeros is None else qw.zeros.float()
    m = zeros - qw.scales.float() * (2 ** (qw.bits - 1)) if qw.bits == 4 else zeros
    # the codes (or their parts) unchanged; K-quant scales described the old zeros: dropped
    return dataclasses.replace(qw, zeros=m, offset_form=True, kscales=None)


def reorder_rows(qw: QuantizedWeight, perm_fn) -> QuantizedWeight:
    """Apply a row permutation (given as a function on (N, ...) tensors) to codes, scales and zeros."""
    qw = qw.materialized()
    return QuantizedWeight(perm_fn(qw.codes), perm_fn(qw.scales), None if qw.zeros is None else perm_fn(qw.zeros),
                           qw.bits, qw.group_size, qw.input_scale, qw.offset_form,
                           None if qw.kscales is None else qw.kscales.map(perm_fn), table=qw.table)


def row_slice(qw: QuantizedWeight, n: int) -> QuantizedWeight:
    """The first ``n`` output rows of ``qw`` (views, no copy; deferred codes stay deferred)."""
    if qw.code_parts is None:
        return reorder_rows(qw, lambda x: x[:n])
    parts, left = [], n
    for c in qw.code_parts:
        if left <= 0:
            break
        parts.append(c[:left] if isinstance(c, torch.Tensor) else c.rows(left))
        left -= parts[-1].shape[0]
    # every other field as reorder_rows slices it (the meta codes included), then the parts' first n rows
    sliced = reorder_rows(dataclasses.replace(qw, code_parts=None), lambda x: x[:n])
    return dataclasses.replace(sliced, code_parts=tuple(parts))


def weight_error_bound(qw: QuantizedWeight) -> torch.Tensor:
    """Largest round-to-nearest error per element: half a step of its group, as an (N, K) tensor."""
    n, k = qw.codes.shape
    return (qw.scales.float() / 2).repeat_interleave(qw.group_size, dim=1).reshape(n, k)


def dequantize_any(w, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if isinstance(w, Fp8Weight):
        return dequantize_fp8(w, dtype)
    if isinstance(w, QuantizedWeight):
        return dequantize(w, dtype)
    return w.to(dtype)
