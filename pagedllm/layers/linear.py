"""Linear layers as small callables: the model calls ``layer(x)`` and does not care how the weight is stored.

``DenseLinear`` holds a full-precision weight; the packed quantized kinds live in ``pagedllm.quant.linear``, and
``build_linear`` picks the kind for a weight. Every kind reports the bytes it keeps (``weight_bytes``) so memory can
be counted without knowing the format.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_ops
from pagedllm.quant.formats import Fp8Weight, dequantize_any
from pagedllm.quant.linear import ACT_DTYPE, QBLOCK, SUBBLOCK, BlockQuantLinear, Fp8Linear, Int4Linear, Int8Linear

logger = logging.getLogger(__name__)


class DenseLinear:
    kind = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, large_steps: bool = False) -> None:
        self.weight: torch.Tensor | None = weight  # (N, K); None once only the pre-packed copy is kept
        self.bias = bias
        self.packed: torch.Tensor | None = None  # oneDNN's blocked layout of the weight (see ``prepack``)
        self.out_features, self.in_features = weight.shape
        self.weight_dtype = weight.dtype  # the dtype its inputs are cast to (kept when only the packed copy is)
        # float32 on a CPU: the kernels' dense_linear (dense.cpp), not F.linear, whose MKL one-row products streamed
        # the weights at 10 GB/s on a Zen 4 (dense_linear: 25); and each output's sum is the same at any number of
        # rows, so a request's rows are bitwise the same alone or batched. ``large_steps``: a packed layer's dense
        # copy, which only steps of many rows run: MKL's GEMM (compute-bound there, it stays ahead of dense_linear's
        # dot products: 140-195 against 105-150 GFLOP/s on a Zen 4, docs/benchmarks.md)
        self.kernels = None
        if weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous() and not large_steps:
            self.kernels = cpu_ops()
            if self.kernels is not None and bias is not None:
                self.bias = bias.float().contiguous()

    def prepack(self, keep_weight: bool) -> "DenseLinear":
        """bfloat16 on CPU: keep the weight in oneDNN's pre-packed (blocked) layout, so each call skips oneDNN's
        per-call reorder of the weight into that layout (faster at every batch size measured; figures in
        docs/history.md). ``keep_weight``: also keep the plain weight (a tied embedding reads its rows). A no-op
        where oneDNN is missing or the dtype differs."""
        w = self.weight
        if (self.packed is not None or w is None or w.dtype != torch.bfloat16 or w.device.type != "cpu"
                or not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                or not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return self
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        except RuntimeError:  # a CPU whose oneDNN build has no bf16 kernels: keep torch's own GEMM
            return self
        if not keep_weight:
            self.weight = None
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, self.bias, "none", [], "")
        if self.kernels is not None and x.dtype == torch.float32:
            y = self.kernels.dense_linear(x.reshape(-1, self.in_features).contiguous(), self.weight, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x.to(self.weight_dtype), self.weight, self.bias)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.packed, self.bias) if t is not None]

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight (for a tied embedding / LM head)."""
        return F.embedding(ids, self.weight)


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors`` (tied weights counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = id(t) if t.is_mkldnn else t.data_ptr()  # an opaque oneDNN tensor has no data pointer
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def runs_on_blocks(w, block_ops, device: torch.device) -> bool:
    """Whether ``build_linear`` runs the stored weight ``w`` on the block kernels (``BlockQuantLinear``): integer
    blocks (a ``QuantizedWeight``, or ``LazyBlocks`` not yet decoded) in groups of a multiple of 16, on a CPU with
    the kernels built."""
    return (block_ops is not None and device.type == "cpu" and hasattr(w, "group_size") and not isinstance(w, Fp8Weight)
            and w.group_size % SUBBLOCK == 0 and w.shape[1] % QBLOCK == 0)


def build_linear(w, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype, dense_min_tokens: int = 0,
                 block_ops=None, dense_dtype: torch.dtype = ACT_DTYPE):
    """The right linear kind for ``w``: a float tensor, a ``QuantizedWeight`` or an ``Fp8Weight``.

    ``block_ops`` (the fused CPU kernels): integer weights in groups of a multiple of 16 run through
    ``BlockQuantLinear``; otherwise through torch's packed kernels. ``dense_min_tokens`` > 0 also keeps a
    ``dense_dtype`` copy for steps of at least that many rows.
    A packed kernel that the device's torch build lacks (or rejects for this shape) falls back to a
    full-precision copy with a warning, so a checkpoint always loads."""
    if isinstance(w, torch.Tensor):
        return DenseLinear(w.to(device=device, dtype=dtype).contiguous(),
                           None if bias is None else bias.to(device=device, dtype=dtype))
    try:
        if isinstance(w, Fp8Weight):
            lin = Fp8Linear(w, bias, device, dtype)
        elif runs_on_blocks(w, block_ops, device):
            lin = BlockQuantLinear(w, bias, device, dtype, block_ops)
        elif getattr(w, "table", None) is not None:  # codes through a table (MXFP4): only the block kernel reads them
            return build_linear(dequantize_any(w), bias, device, dtype)
        elif (w := w.materialized()).bits == 8 and w.symmetric and w.group_size == w.shape[1]:
            lin = Int8Linear(w, bias, device, dtype)
        elif w.bits == 4:
            lin = Int4Linear(w, bias, device, dtype)
        else:
            raise ValueError(f"no packed kernel for {w.bits}-bit weights with group size {w.group_size} "
                             f"(8-bit needs one symmetric scale per output channel)")
        lin(torch.zeros(1, lin.in_features, device=device, dtype=dtype))  # probe the kernel once
        if dense_min_tokens > 0:
            full = dequantize_any(w).to(device).to(dense_dtype).contiguous()
            lin.keep_dense(DenseLinear(full, large_steps=True).prepack(keep_weight=False), dense_min_tokens)
        return lin
    except (RuntimeError, NotImplementedError) as e:
        logger.warning("packed kernel unavailable on %s (%s); using a dequantized %s copy", device, e, dtype)
        return build_linear(dequantize_any(w), bias, device, dtype)
