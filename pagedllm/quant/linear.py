"""Linear layers that compute with packed quantized weights (no full-precision copy of the weight per step).

- ``Int8Linear``: symmetric per-output-channel int8 through ``torch._weight_int8pack_mm``.
- ``Int4Linear``: group-wise 4-bit through torch's packed int4 matmul (``_weight_int4pack_mm_for_cpu`` on CPU,
  ``_weight_int4pack_mm`` on CUDA), dequantizing inside the kernel; AWQ's input scaling is one multiply on x.
- ``Fp8Linear``: float8 e4m3 weights with per-channel scales through ``torch._scaled_mm`` (activations are
  quantized per token to e4m3 on the fly, as vLLM's fp8 does); native on CUDA sm89+, oneDNN on CPU.

The kernels run with bfloat16 activations (torch's packed kernels take bf16 on CPU; they are 5-15x slower with
float32 inputs); inputs are cast to bf16 and the output back to the model's dtype.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from pagedllm.layers.linear import DenseLinear
from pagedllm.quant.formats import FP8_MAX, Fp8Weight, QuantizedWeight, dequantize_any

logger = logging.getLogger(__name__)

ACT_DTYPE = torch.bfloat16


class _Packed:
    bias: torch.Tensor | None
    out_dtype: torch.dtype
    dense: DenseLinear | None = None  # optional bf16 copy for large steps (see ``keep_dense``)
    dense_min_tokens: int = 0

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        y = y.to(self.out_dtype)
        return y if self.bias is None else y + self.bias

    def keep_dense(self, full: torch.Tensor, min_tokens: int) -> None:
        """Also keep ``full`` (the effective weight) in bf16 and use it for steps of >= ``min_tokens`` rows: the
        packed kernels are compute-bound at large M, where oneDNN's bf16 GEMM (AMX) is several times faster."""
        self.dense = DenseLinear(full.to(ACT_DTYPE).contiguous()).prepack(keep_weight=False)
        self.dense_min_tokens = min_tokens

    def _common_init(self, input_scale: torch.Tensor | None, bias: torch.Tensor | None, device: torch.device,
                     dtype: torch.dtype) -> None:
        self.input_scale = None if input_scale is None else (1.0 / input_scale.float()).to(device, ACT_DTYPE)
        self.bias = None if bias is None else bias.to(device, dtype)
        self.out_dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= self.dense_min_tokens:
            return self._finish(self.dense(x.to(ACT_DTYPE)))
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


def build_linear(w, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype, dense_min_tokens: int = 0):
    """The right linear kind for ``w``: a float tensor, a ``QuantizedWeight`` or an ``Fp8Weight``.

    ``dense_min_tokens`` > 0 also keeps a bf16 copy for steps of at least that many rows.
    A packed kernel that the device's torch build lacks (or rejects for this shape) falls back to a
    full-precision copy with a warning, so a checkpoint always loads."""
    if isinstance(w, torch.Tensor):
        return DenseLinear(w.to(device=device, dtype=dtype).contiguous(),
                           None if bias is None else bias.to(device=device, dtype=dtype))
    try:
        if isinstance(w, Fp8Weight):
            lin = Fp8Linear(w, bias, device, dtype)
        elif w.bits == 8 and w.symmetric and w.group_size == w.shape[1]:
            lin = Int8Linear(w, bias, device, dtype)
        elif w.bits == 4:
            lin = Int4Linear(w, bias, device, dtype)
        else:
            raise ValueError(f"no packed kernel for {w.bits}-bit weights with group size {w.group_size} "
                             f"(8-bit needs one symmetric scale per output channel)")
        lin(torch.zeros(1, lin.in_features, device=device, dtype=dtype))  # probe the kernel once
        if dense_min_tokens > 0:
            lin.keep_dense(dequantize_any(w).to(device), dense_min_tokens)
        return lin
    except (RuntimeError, NotImplementedError) as e:
        logger.warning("packed kernel unavailable on %s (%s); using a dequantized %s copy", device, e, dtype)
        return build_linear(dequantize_any(w), bias, device, dtype)
