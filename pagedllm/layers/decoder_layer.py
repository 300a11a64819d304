"""One transformer layer, pre-norm: RMSNorm -> attention -> (sandwich norm) -> residual add -> RMSNorm -> MLP or
MoE -> (sandwich norm) -> residual add (-> Gemma 4's per-layer input, its layer scalar), over one ops backend
(``layers.ops``).

The residual stream ``h`` is added to in place and each add is folded into the norm that follows it: a layer
receives its input already normalised and returns the next layer's normalised input (``next_norm``: the next
layer's input norm, or the model's final norm)."""

from __future__ import annotations

import torch

from pagedllm.layers.attention import Attention
from pagedllm.layers.mlp import DenseAndExperts, GatedMLP, MoE
from pagedllm.layers.per_layer_inputs import PerLayerInput


class DecoderLayer:
    def __init__(self, input_norm: torch.Tensor, post_norm: torch.Tensor, attn: Attention,
                 mlp: GatedMLP | MoE | DenseAndExperts,
                 eps: float, attn_out_norm: torch.Tensor | None = None, mlp_out_norm: torch.Tensor | None = None,
                 tp=None, per_layer: PerLayerInput | None = None, scalar: torch.Tensor | None = None,
                 residual_scale: float = 1.0) -> None:
        """``post_norm``: the norm before the MLP; ``attn_out_norm`` / ``mlp_out_norm``: gemma's sandwich norms on
        each block's output; ``tp``: the tensor-parallel group that sums the row-parallel outputs (None: one
        rank); ``per_layer``: Gemma 4's per-layer input, mixed in after the MLP; ``scalar``: the residual stream
        times it at the layer's end (Gemma 4); ``residual_scale``: each block's output times it before its residual
        add (Granite)."""
        self.input_norm, self.post_norm, self.attn, self.mlp, self.eps = input_norm, post_norm, attn, mlp, eps
        self.attn_out_norm, self.mlp_out_norm, self.tp = attn_out_norm, mlp_out_norm, tp
        self.per_layer, self.scalar, self.residual_scale = per_layer, scalar, residual_scale

    def linear_slots(self, prefix: str):
        """(name, owner, attribute) of each linear: the names ``model.loader`` gives their weights."""
        yield from self.attn.linear_slots(prefix)
        yield from self.mlp.linear_slots(prefix)
        if self.per_layer is not None:
            yield from self.per_layer.linear_slots(prefix)

    def norms(self) -> dict[str, torch.Tensor]:
        out = {"input_norm": self.input_norm, "post_norm": self.post_norm, **self.attn.norms()}
        out.update(self.mlp.norms() if hasattr(self.mlp, "norms") else {})
        if self.attn_out_norm is not None:
            out.update(attn_out_norm=self.attn_out_norm, mlp_out_norm=self.mlp_out_norm)
        if self.per_layer is not None:
            out["ple_norm"] = self.per_layer.norm
        if self.scalar is not None:
            out["layer_scalar"] = self.scalar
        return out

    def forward(self, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, rot, kv: tuple, meta,
                next_norm: torch.Tensor, ops, layer_input: torch.Tensor | None = None) -> torch.Tensor:
        """x: this layer's normalised input (T, H); h: the residual stream (updated in place) -> the next layer's
        normalised input. ``layer_input``: its per-layer input rows (T, size), with ``per_layer``."""
        tp = self.tp
        o = self.attn(x, positions, rot, kv, meta, ops)
        if tp is not None:  # row-parallel: partial sums
            o = tp.all_reduce(o)
        if self.attn_out_norm is not None:
            o = ops.rms_norm(o, self.attn_out_norm, self.eps)
        if self.residual_scale != 1.0:
            o = o * self.residual_scale
        x = ops.add_rms_norm(h, o, self.post_norm, self.eps)
        m = self.mlp(x, ops, h) if getattr(self.mlp, "takes_residual", False) else self.mlp(x, ops)
        if tp is not None:
            m = tp.all_reduce(m)
        if self.mlp_out_norm is not None:
            m = ops.rms_norm(m, self.mlp_out_norm, self.eps)
        if self.residual_scale != 1.0:
            m = m * self.residual_scale
        if self.per_layer is None and self.scalar is None:
            return ops.add_rms_norm(h, m, next_norm, self.eps)
        h.add_(m)
        if self.per_layer is not None:
            self.per_layer(h, layer_input, ops)
        if self.scalar is not None:
            h.mul_(self.scalar.to(h.dtype))
        return ops.rms_norm(h, next_norm, self.eps)

    __call__ = forward
