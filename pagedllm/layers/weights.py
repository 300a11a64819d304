"""Where a layer takes its weights from: the loaded checkpoint's dict (named as ``model.loader`` names them), each
array popped as it is placed (loading peaks near one copy of the weights instead of two), and the linears built
as the model's build settings say (quantization policy, block kernels, dense copies, linear dtype)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.layers.linear import build_linear
from pagedllm.quant.formats import concat, dequantize
from pagedllm.quant.gguf_blocks import BlockRows, LazyBlocks
from pagedllm.quant.policy import QuantPolicy, quantize_weight

LM_HEAD_DENSE_MIN_TOKENS = 2  # with a dense copy kept (--quant-dense-min-tokens), the head uses it from 2 rows


@dataclass
class LinearBuild:
    """How a model's linears are built.

    ``quant`` quantizes float weights at load time (round to nearest) by layer type. ``block_ops`` (the fused CPU
    kernels): integer weights in groups of 32 run through their ``qlinear`` kernel (``BlockQuantLinear``).
    ``dense_min_tokens`` > 0: packed layers also keep a ``dense_dtype`` copy, used for steps of at least that many
    tokens (the LM head: ``head_dense_min_tokens``, by default the smaller of the two). ``linear_dtype``: the layers'
    float linear weights in this dtype (bfloat16 under float32 activations: the GEMMs in bfloat16; the embedding and
    head keep the model's dtype). The block kernels' linears take ``act_bits`` (8: one int8 level per block of 32
    activations; 16: two) and, in the layers (not the LM head), ``large_step_min_tokens`` (> 0: steps of at least
    that many rows run on bfloat16 stripes of the weights, ``BlockQuantLinear._stripes``) and ``mid_step_min_rows``
    (by the weights' code bits: smaller steps of at least that many rows run the kernels' bfloat16 tiles, the same
    numerics)."""

    quant: QuantPolicy | None = None
    block_ops: object = None
    dense_min_tokens: int = 0
    head_dense_min_tokens: int | None = None
    dense_dtype: torch.dtype = torch.bfloat16
    linear_dtype: torch.dtype | None = None
    act_bits: int = 16  # 8 or 16 (``--activation-bits``, checked where the flag is read)
    large_step_min_tokens: int = 0
    # code bits -> rows from which a layer's smaller steps (below large_step_min_tokens) run on bfloat16 tiles
    mid_step_min_rows: dict[int, int] = field(default_factory=dict)


class WeightSource:
    def __init__(self, weights: dict, device: torch.device, dtype: torch.dtype, build: LinearBuild,
                 norm_float32: bool = False) -> None:
        self.weights, self.device, self.dtype, self.build = weights, device, dtype, build
        self.norm_dtype = torch.float32 if norm_float32 else dtype  # where the architecture's norm multiplies in fp32

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def pop(self, name: str):
        if name not in self.weights:
            raise KeyError(f"weight {name!r} missing from the checkpoint")
        return self.weights.pop(name)

    def lookup_table(self, name: str):
        """A table the model only looks rows up in (an untied embedding): with the block kernels, a GGUF tensor
        whose blocks decode in place stays in the file's memory map (``BlockRows``); otherwise a linear as
        ``linear`` builds it (a quantized policy, a float checkpoint, a tensor-parallel slice)."""
        pop_blocks = getattr(self.weights, "pop_blocks", None)
        if self.build.block_ops is not None and self.build.quant is None and pop_blocks is not None:
            lazy = self.weights.peek(name)
            if isinstance(lazy, LazyBlocks) and lazy.post is None:
                return BlockRows(pop_blocks(name), self.dtype)
        return self.linear(name, [name], "embed")

    def float_tensor(self, name: str) -> torch.Tensor:
        """A small float weight, dequantized where the file stores it in blocks (e.g. a MoE router)."""
        w = self.pop(name)
        return (w if isinstance(w, torch.Tensor) else dequantize(w)).to(device=self.device, dtype=self.dtype).contiguous()

    def norm(self, name: str) -> torch.Tensor:
        return self.pop(name).to(device=self.device, dtype=self.norm_dtype).contiguous()

    def linear(self, fused: str, parts: list[str], layer_type: str, bias: torch.Tensor | None = None,
               dense: bool = True):
        """The linear ``fused`` as stored, or its ``parts`` fused (stacked rows). A float weight, or one already
        quantized (``QuantizedWeight`` / ``Fp8Weight``, e.g. from a quantized checkpoint, where fused weights are
        stored under their fused names). ``dense``: it may keep a dense copy for large steps."""
        b = self.build
        if fused in self.weights:
            w = self.pop(fused)
        else:
            ws = [self.pop(p) for p in parts]
            # the block kernel packs fused parts from their own codes (no concatenated copy of a byte per weight)
            w = torch.cat(ws, dim=0) if isinstance(ws[0], torch.Tensor) else concat(
                ws, defer_codes=b.block_ops is not None)
        if isinstance(w, torch.Tensor) and b.quant is not None:
            w = quantize_weight(w.float(), b.quant.scheme(layer_type), b.quant)
        min_tokens = b.dense_min_tokens if dense else 0
        if layer_type == "lm_head" and b.head_dense_min_tokens is not None:
            min_tokens = b.head_dense_min_tokens
        elif layer_type == "lm_head" and b.dense_min_tokens > 0:
            # the packed int8 head only wins at one row
            min_tokens = min(b.dense_min_tokens, LM_HEAD_DENSE_MIN_TOKENS)
        layer = layer_type in ("attn", "mlp")
        lin = build_linear(w, bias, self.device, b.linear_dtype if b.linear_dtype is not None and layer else self.dtype,
                           min_tokens, b.block_ops, b.dense_dtype)
        if hasattr(lin, "act_levels"):  # a block-kernel linear
            lin.act_levels = 1 if b.act_bits == 8 else 2
            if layer:  # (a step's head computes a few rows: it keeps its blocks)
                lin.bf16_min_tokens = b.large_step_min_tokens
                lin.bf16_tile_min_rows = b.mid_step_min_rows.get(lin.bits, 0)
        return lin
