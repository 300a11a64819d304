"""Linear layers that compute with packed quantized weights (no full-precision copy of the weight per step).

- ``Int8Linear``: symmetric per-output-channel int8 through ``torch._weight_int8pack_mm``.
- ``Int4Linear``: group-wise 4-bit through torch's packed int4 matmul (``_weight_int4pack_mm_for_cpu`` on CPU,
  ``_weight_int4pack_mm`` on CUDA), dequantizing inside the kernel; AWQ's input scaling is one multiply on x.
- ``BlockQuantLinear``: 4-bit or 8-bit codes in blocks of 32 input channels with a scale and an offset per block
  (a GGUF file's Q4_0/Q4_1/Q8_0 blocks as they are, or any group size that is a multiple of 32) through the fused
  CPU kernel ``qlinear``: activations quantized per block to two int8 levels (about 15 bits), integer dot
  products (AVX2 / AVX512-VNNI), float activations in and out.
- ``Fp8Linear``: float8 e4m3 weights with per-channel scales through ``torch._scaled_mm`` (activations are
  quantized per token to e4m3 on the fly, as vLLM's fp8 does); native on CUDA sm89+, oneDNN on CPU.

torch's kernels run with bfloat16 activations (torch's packed kernels take bf16 on CPU and are several times
slower with float32 inputs); inputs are cast to bf16 and the output back to the model's dtype.
``layers.linear.build_linear`` picks the kind for a weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.gguf_file import BLOCK_TYPES
from pagedllm.quant.formats import FP8_MAX, Fp8Weight, QuantizedWeight
from pagedllm.quant.gguf_blocks import PLAIN_CODES

ACT_DTYPE = torch.bfloat16
QBLOCK = 32  # input channels per block of BlockQuantLinear
SUBBLOCK = 16  # the smallest group it runs: a scale (and offset) per half block
KSUPER = 256  # inputs per GGUF K-quant super-block
# weight rows decoded to bfloat16 at a time by BlockQuantLinear's large steps (6 MiB at K=1536): oneDNN's AMX GEMM
# splits a call's work into chunks by its M and N, and on 2 threads a 512-row stripe with 512-1152 rows of
# activations (K=1536; 384-1280 at K=8960) is one chunk, on one core; 2048-row stripes keep both busy there
# (docs/benchmarks.md)
STRIPE_ROWS = 2048
assert STRIPE_ROWS % 16 == 0  # whole groups of 8 rows, also for the gate and the up half of a gated stripe


def _narrow_bits(part) -> int:
    """The fewest bits (5, 6 or 8) that hold a weight part's 8-bit codes, as the kernels pack them (qlinear.h): code
    tensors (stored s + 128) by their range, a GGUF tensor's raw blocks by their type (4-bit codes widened into an
    8-bit layer lie in [0, 16))."""
    if isinstance(part, torch.Tensor):
        lo, hi = (int(v) for v in torch.aminmax(part))
        return 5 if 112 <= lo and hi < 144 else 6 if 96 <= lo and hi < 160 else 8
    return 5 if part.widen else BLOCK_TYPES[part.kind].narrow


def _narrow_kernels(ops) -> bool:
    """Whether 8-bit codes that fit 5 or 6 bits are packed so: where the kernels have 512-bit VNNI. On a Zen 4
    (docs/benchmarks.md): Qwen2.5-Coder 0.5B's Q5_0 layers one row 24-30% faster (5/8 of the code bytes), 8 rows
    even, 32 / 256 rows 4-8% slower (the tiles rebuild the codes), served C=1 +8-12%, C=8 even, C=32 -2.5..-4.7%;
    the 1.5B's Q6_K head and layers one row 35% / 19% faster (3/4 of the bytes; a step 11-12%), 32 rows 11-17%
    slower. The AVX2 tiles rebuilt 5-bit codes 5% / 10% slower at 8 / 32 rows (one row 25-33% faster): those
    builds keep 8 bits."""
    return "+vnni" in ops.isa()


class _Packed:
    bias: torch.Tensor | None
    out_dtype: torch.dtype
    dense = None  # optional dense copy (a ``layers.linear.DenseLinear``) for large steps (see ``keep_dense``)
    dense_min_tokens: int = 0

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        if y.dtype != self.out_dtype:  # (a no-op ``to`` still costs ~1 us: 2% of SmolLM2's decode step)
            y = y.to(self.out_dtype)
        return y if self.bias is None else y + self.bias

    def keep_dense(self, dense, min_tokens: int) -> None:
        """Also keep ``dense`` (the effective weight as a ``DenseLinear``, e.g. bf16 pre-packed for oneDNN) and use
        it for steps of >= ``min_tokens`` rows: the packed kernels are compute-bound at large M, where a dense GEMM
        can be faster (several times with AMX)."""
        self.dense = dense
        self.dense_min_tokens = min_tokens

    def _common_init(self, input_scale: torch.Tensor | None, bias: torch.Tensor | None, device: torch.device,
                     dtype: torch.dtype) -> None:
        self.input_scale = None if input_scale is None else (1.0 / input_scale.float()).to(device, ACT_DTYPE)
        self.bias = None if bias is None else bias.to(device, dtype)
        self.out_dtype = dtype

    def _takes_dense(self, x: torch.Tensor) -> bool:
        """Whether the dense copy (``keep_dense``) runs this step."""
        return self.dense is not None and x.shape[0] >= self.dense_min_tokens

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes_dense(x):
            return self._finish(self.dense(x.to(self.dense.weight_dtype)))
        return self._finish(self._kernel(x))

    def _scaled_input(self, x: torch.Tensor) -> torch.Tensor:
        """x in the packed kernels' bf16, with AWQ's per-channel input scaling applied."""
        x = x.to(ACT_DTYPE)
        return x if self.input_scale is None else x * self.input_scale

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self._tensors() if t is not None] + (self.dense.tensors() if self.dense is not None else [])


class Int8Linear(_Packed):
    kind = "int8"

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
                 dtype: torch.dtype) -> None:
        if qw.bits != 8 or not qw.symmetric or qw.group_size != qw.shape[1]:
            raise ValueError("Int8Linear needs symmetric 8-bit weights with one scale per output channel")
        self.out_features, self.in_features = qw.shape
        self.weight = (qw.codes.to(torch.int16) - 128).to(torch.int8).to(device).contiguous()  # (N, K)
        self.row_scales = qw.scales[:, 0].float().to(device)  # (N,) float32, for embedding rows
        self.scales = self.row_scales.to(ACT_DTYPE)
        self._common_init(qw.input_scale, bias, device, dtype)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(self._scaled_input(x), self.weight, self.scales)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the (tied) weight, dequantized only for the looked-up ids."""
        return (self.weight[ids].float() * self.row_scales[ids].unsqueeze(-1)).to(self.out_dtype)

    def _tensors(self) -> list:
        return [self.weight, self.scales, self.input_scale, self.bias]


class Int4Linear(_Packed):
    kind = "int4"

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
                 dtype: torch.dtype) -> None:
        if qw.bits != 4:
            raise ValueError("Int4Linear needs 4-bit weights")
        self.out_features, self.in_features = qw.shape
        self.group_size = qw.group_size
        zeros = qw.zeros if qw.zeros is not None else torch.zeros_like(qw.scales)
        if qw.offset_form:  # w = q*d + m = (q - 8)*d + (m + 8d)
            zeros = zeros.float() + 8 * qw.scales.float()
        # (K/G, N, 2): [scale, zero] per group, the layout torch's kernels expect
        self.scales_and_zeros = torch.stack([qw.scales.float(), zeros.float()], -1).transpose(0, 1).contiguous().to(
            device, ACT_DTYPE)
        codes = qw.codes.to(device)
        if device.type == "cuda":
            packed_u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()
            self.weight = torch._convert_weight_to_int4pack(packed_u8, 8)
            self._mm = torch._weight_int4pack_mm
        else:
            self.weight = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
            self._mm = torch._weight_int4pack_mm_for_cpu
        self._common_init(qw.input_scale, bias, device, dtype)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self._mm(self._scaled_input(x), self.weight, self.group_size, self.scales_and_zeros)

    def _tensors(self) -> list:
        return [self.weight, self.scales_and_zeros, self.input_scale, self.bias]


def _implied_zero(d: torch.Tensor, m: torch.Tensor) -> int:
    """The integer z > 0 with m == -z * d for every block (a table's values stored shifted by z: MXFP4's 16), or 0."""
    nz = d != 0
    if not bool(nz.any()) or bool(m[~nz].any()):
        return 0
    z = -(m[nz].double() / d[nz].double())
    z0 = float(z.flatten()[0])
    return int(z0) if z0 > 0 and z0 == int(z0) and bool((z == z0).all()) and torch.equal(m, -z0 * d) else 0


class BlockQuantLinear(_Packed):
    """Blocks of 32 input channels: ``w = d * u + m`` per block (``u`` 4-bit codes in [0, 16), their table's values
    where the weight has one (MXFP4), or signed 8-bit codes), computed by the fused CPU kernel ``qlinear`` from the packed codes (0.5 or 1 byte per weight), output
    rows interleaved in groups of 8 (layout: ``kernels/csrc/qlinear.h``). Weights in groups of 16 (GGUF Q2_K, Q3_K,
    Q6_K) keep a scale and offset per half block (``sub`` 2). Scale and offset are float16 when every one of the
    layer's values is exactly a float16 (a GGUF file's own), else float32; 8-bit weights' offsets that are all zero
    (Q8_0, symmetric weights) are not stored at all.
    """

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
                 ops) -> None:
        if ops is None or device.type != "cpu":
            raise ValueError("BlockQuantLinear needs the fused CPU kernels")
        if qw.group_size % SUBBLOCK or qw.bits not in (4, 8):
            raise ValueError(f"BlockQuantLinear needs 4/8-bit weights in groups of a multiple of {SUBBLOCK}")
        self.kind = f"q{qw.bits}-block"
        self.bits = qw.bits
        self.table = qw.table  # 4-bit codes through a table (MXFP4), or None
        self.table_zero = 0  # > 0: no offsets stored, each is -table_zero * scale (the table's values + table_zero)
        self.ops = ops
        self.out_features, self.in_features = n, k = qw.shape
        if k % QBLOCK:
            raise ValueError(f"BlockQuantLinear needs in_features a multiple of {QBLOCK}, got {k}")
        self.sub = sub = 2 if qw.group_size % QBLOCK else 1  # scales per block of 32
        nb, ng = k // QBLOCK, (n + 7) // 8
        codes = qw.codes
        pad = ng * 8 - n  # zero rows up to a whole group of 8 (their outputs are not stored)
        # the interleaved layout (kernels' pack.cpp), padded with zero weights; a fused weight's parts one after
        # another (no concatenated copy), a GGUF tensor's codes decoded from its blocks as they are packed
        parts = qw.code_parts if qw.code_parts is not None else (codes,)
        sources = [(c.contiguous().numpy(), PLAIN_CODES, len(c), False) if isinstance(c, torch.Tensor) else c.source()
                   for c in parts]
        # the packed layout's bits per code (the kernels' ``bits``): 4, 8, or 5 / 6 for 8-bit codes in [-16, 16) /
        # [-32, 32) (GGUF Q5_0 / Q6_K, Q5_K: 5/8 / 3/4 of the code bytes a decode step streams, the same results)
        narrow = qw.bits == 8 and _narrow_kernels(ops)
        self.layout_bits = max(map(_narrow_bits, parts)) if narrow else qw.bits
        self.codes = ops.pack_parts(sources, self.layout_bits, k)
        for c in parts:
            if getattr(c, "release", None) is not None:
                c.release()  # the file's pages of these blocks: not read again
        del codes, parts, sources

        def groups(v: torch.Tensor) -> torch.Tensor:  # (N, K/32 * sub) -> (N/8, K/32 * sub * 8)
            return F.pad(v, (0, 0, 0, pad)).reshape(ng, 8, nb * sub).transpose(1, 2).reshape(ng, nb * sub * 8
                                                                                           ).contiguous()

        ks = qw.kscales
        self.super_scales = self.super_offsets = None  # K-quant form: float16 per super-block of 256 inputs
        if ks is not None and k % KSUPER == 0 and qw.input_scale is None:
            # the file's own scales: int8 per sub-block (and row) times float16 per super-block, 1 byte instead of 4
            def supers(v: torch.Tensor) -> torch.Tensor:  # (N, K/256) -> (N/8, K/256 * 8)
                return F.pad(v, (0, 0, 0, pad)).reshape(ng, 8, -1).transpose(1, 2).reshape(ng, -1).contiguous()

            rep_k = ks.sub_d.shape[1] and (nb * sub) // ks.sub_d.shape[1]
            sub_d = ks.sub_d.repeat_interleave(rep_k, dim=1) if rep_k > 1 else ks.sub_d
            self.scales, self.super_scales = groups(sub_d), supers(ks.super_d)
            if ks.sub_m is not None and (self.bits == 4 or bool(ks.sub_m.any())):
                sub_m = ks.sub_m.repeat_interleave(rep_k, dim=1) if rep_k > 1 else ks.sub_m
                self.offsets, self.super_offsets = groups(sub_m), supers(ks.super_m)
            else:
                self.offsets, self.super_offsets = self.scales.new_empty(0), self.super_scales.new_empty(0)
        else:
            # float32 scales per block of 32 (or 16), built only here: a K-quant head's would be a transient 58 MB
            # (the 1.5B's) beside its packing, at the start's peak memory
            rep = qw.group_size * sub // QBLOCK
            d = qw.scales.float()
            d = d.repeat_interleave(rep, dim=1) if rep > 1 else d  # (N, K/32 * sub)
            zero = None if qw.zeros is None else qw.zeros.float()
            if zero is not None and rep > 1:
                zero = zero.repeat_interleave(rep, dim=1)
            half = 2 ** (qw.bits - 1)  # w = (q - half) * d + zero
            if qw.bits == 4:  # w = d*q + m
                m = zero if qw.offset_form else (0 if zero is None else zero) - half * d
            else:  # w = d*s + zero with s = q - 128: the code's sign bit flipped (pack_parts, above)
                m = zero
            if m is not None and self.bits == 8 and not m.any():
                m = None  # all 0, not stored
            if self.table is not None and m is not None and (zero := _implied_zero(d, m)):
                m, self.table_zero = None, zero  # MXFP4: the offsets follow from the scales, none streamed
            if torch.equal(d.half().float(), d) and (m is None or torch.equal(m.half().float(), m)):  # exact
                d, m = d.half(), None if m is None else m.half()  # (before the grouping's copies: half their bytes)
            d, m = groups(d), None if m is None else groups(m)
            self.scales = d
            self.offsets = m if m is not None else d.new_empty(0)  # empty: all 0, skipped by the kernel
        self.input_scale = None if qw.input_scale is None else (1.0 / qw.input_scale.float()).to(dtype)
        self.bias = None if bias is None else bias.to(device, dtype)
        self.out_dtype = dtype
        # the activations' quantization per block of 32 (kernels' QuantizedRows): 2 int8 levels (~15 bits), or 1
        # (8 bits, --activation-bits 8: the fine level's products skipped)
        self.act_levels = 2
        # steps of at least this many rows run on bfloat16 stripes of the weights (``_stripes``); 0: never
        self.bf16_min_tokens = 0
        # steps of at least this many rows (and below bf16_min_tokens) run qlinear's bfloat16 tiles (levels 0: the
        # weights decoded to bfloat16 inside the kernel, AMX-BF16); 0: never
        self.bf16_tile_min_rows = 0

    def weight_bf16(self, g0: int, g1: int) -> torch.Tensor:
        """Weight rows ``8 g0 .. min(8 g1, N) - 1`` decoded to bfloat16 by the kernels: (rows, K)."""
        if self.super_scales is not None:
            return self.ops.qweight_k_bf16(self.codes, self.scales, self.offsets, self.super_scales,
                                           self.super_offsets, self.layout_bits, self.out_features, g0, g1)
        return self.ops.qweight_bf16(self.codes, self.scales, self.offsets, self.layout_bits, self.out_features, g0, g1,
                                     self.table, self.table_zero)

    def _stripes(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T with W decoded to bfloat16 a stripe of ``STRIPE_ROWS`` outputs at a time (held only while its GEMM
        runs) and bf16 activations, through torch's GEMM (oneDNN: AMX or AVX512-BF16 tiles): the path of large
        steps (``bf16_min_tokens``), several times the block kernels' integer throughput on such CPUs."""
        xb = x.to(torch.bfloat16)
        n = self.out_features
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        step = STRIPE_ROWS // 8
        for g0 in range(0, (n + 7) // 8, step):
            g1 = min(g0 + step, (n + 7) // 8)
            y[:, 8 * g0:min(8 * g1, n)] = F.linear(xb, self.weight_bf16(g0, g1))
        return y

    def gated(self, x: torch.Tensor, act_and_mul, down) -> torch.Tensor | None:
        """``down(act_and_mul(self(x)))`` for this fused gate/up projection (gate rows, then as many up rows) on
        bfloat16 stripes, where the step is large enough for them (``bf16_min_tokens``); None where it is not. Each
        stripe of the intermediate columns decodes its gate and up rows together, and the activation product stays
        bfloat16 (the down projection's stripes take bf16 inputs): no float32 gate/up output is written, and the
        rows need not go in pieces (a piece would decode every weight again). A dense copy the weight plan keeps
        for large steps (``keep_dense``) takes precedence, as in ``__call__``."""
        inter = self.out_features // 2
        if not (self.bf16_min_tokens and x.shape[0] >= self.bf16_min_tokens and inter % 8 == 0
                and not self._takes_dense(x)
                and getattr(down, "bf16_min_tokens", 0) and self.input_scale is None and self.bias is None):
            return None
        xb = x.to(torch.bfloat16)
        h = torch.empty(x.shape[0], inter, dtype=torch.bfloat16)
        step = STRIPE_ROWS // 2
        for j in range(0, inter, step):
            j1 = min(j + step, inter)
            w = torch.cat([self.weight_bf16(j // 8, j1 // 8), self.weight_bf16((inter + j) // 8, (inter + j1) // 8)])
            h[:, j:j1] = act_and_mul(F.linear(xb, w))
        return down(h)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        if self.input_scale is not None:
            x = x * self.input_scale.to(x.dtype)
        if self.bf16_min_tokens and x.shape[0] >= self.bf16_min_tokens:
            return self._stripes(x)
        levels = self.act_levels
        if self.bf16_tile_min_rows and x.shape[0] >= self.bf16_tile_min_rows and self.ops.bf16_tiles():
            levels = 0  # the same numerics as the stripes: bfloat16 weights and activations, float32 sums
        if self.super_scales is not None:
            return self.ops.qlinear_k(x.contiguous(), self.codes, self.scales, self.offsets, self.super_scales,
                                      self.super_offsets, self.layout_bits, self.out_features, levels)
        return self.ops.qlinear(x.contiguous(), self.codes, self.scales, self.offsets, self.layout_bits,
                                self.out_features,
                                levels, self.table, self.table_zero)

    def _rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        """Float32 weight rows ``ids`` (all rows when None), decoded from the interleaved layout."""
        n, k = self.out_features, self.in_features
        nb = k // QBLOCK
        g = torch.arange(n) if ids is None else ids.reshape(-1)
        grp, row = g // 8, g % 8
        t = len(g)
        at = torch.arange(t)
        if self.layout_bits == 4:
            c = self.codes[grp].reshape(t, nb, 4, 8, 4)[at, :, :, row]  # (T, nb, i, t)
            q = torch.stack([c & 0xF, c >> 4], dim=2)  # (T, nb, h, i, t): element 16h + 4i + t
            q = (q if self.table is None else self.table[q.long()]).float()
        elif self.layout_bits in (5, 6):  # the 4-bit layout of u = s + 2^(bits-1), then bytes (row, t) of high bits
            lb = self.layout_bits
            blk = self.codes[grp].reshape(t, nb, 32 * lb)
            c = blk[:, :, :128].reshape(t, nb, 4, 8, 4)[at, :, :, row].long()  # (T, nb, i, t)
            planes = blk[:, :, 128:].reshape(t, nb, lb - 4, 8, 4)[at, :, :, row].long()  # (T, nb, plane, t)
            if lb == 5:  # unit's bit 4 at bit unit
                high = (planes >> torch.arange(8).view(1, 1, 8, 1)) & 1  # (T, nb, unit, t)
            else:  # unit 4v + k's bits 4-5 at bits 2k, 2k+1 of plane v
                high = ((planes.unsqueeze(3) >> (2 * torch.arange(4)).view(1, 1, 1, 4, 1)) & 3).reshape(t, nb, 8, 4)
            u = torch.stack([c & 0xF, c >> 4], dim=2) | high.view(t, nb, 2, 4, 4) << 4  # element 16h + 4i + t
            q = (u - 2 ** (lb - 1)).float()
        else:
            q = self.codes[grp].view(torch.int8).reshape(t, nb, 8, 8, 4)[at, :, :, row].float()
        sub = self.sub

        def per_row(v: torch.Tensor, sup: torch.Tensor | None) -> torch.Tensor:  # (T, nb * sub) float32
            out = v[grp].float().reshape(t, nb * sub, 8)[at, :, row]
            if sup is not None:  # K-quant form: times the super-block's float16 scale (exact in float32)
                out = out * sup[grp].float().reshape(t, -1, 8)[at, :, row].repeat_interleave(8 * sub, dim=1)
            return out

        sc = per_row(self.scales, self.super_scales)
        off = per_row(self.offsets, self.super_offsets) if self.offsets.numel() else -self.table_zero * sc
        w = q.reshape(t, nb * sub, QBLOCK // sub) * sc.unsqueeze(-1) + off.unsqueeze(-1)
        return w.reshape(t, k)

    def dequantized(self) -> torch.Tensor:
        """The effective (N, K) float32 weight."""
        w = self._rows(None)
        if self.input_scale is not None:
            w = w * self.input_scale.float()  # the layer computes (x * input_scale) W^T
        return w

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the (tied) table, dequantized only for the looked-up ids."""
        return self._rows(ids).reshape(*ids.shape, self.in_features).to(self.out_dtype)

    def _tensors(self) -> list:
        return [self.codes, self.scales, self.offsets, self.super_scales, self.super_offsets, self.input_scale,
                self.bias]


class Fp8Linear(_Packed):
    kind = "fp8"

    def __init__(self, fw: Fp8Weight, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> None:
        self.out_features, self.in_features = fw.shape
        self.weight_t = fw.data.to(device).t()  # (K, N) column-major view, as _scaled_mm wants its second operand
        self.scales = fw.scales.float().to(device).view(1, -1)
        self._common_init(None, bias, device, dtype)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sx = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # per-token activation scale
        x8 = (xf / sx).to(torch.float8_e4m3fn)
        return torch._scaled_mm(x8, self.weight_t, scale_a=sx, scale_b=self.scales, out_dtype=ACT_DTYPE)

    def _tensors(self) -> list:
        return [self.weight_t, self.scales, self.bias]
