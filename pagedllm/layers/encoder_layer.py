"""BERT's post-norm encoder layer: attention over each whole text (both ways, q/k/v/o biases, no rotary), add,
LayerNorm; an ungated GELU MLP with biases, add, LayerNorm. The residual stream is what each LayerNorm returns (no
pre-norm, nothing folded into the next layer)."""

from __future__ import annotations

import torch

from pagedllm.layers.attention import Attention
from pagedllm.layers.mlp import MLP
from pagedllm.layers.weights import WeightSource


class PostNormLayer:
    def __init__(self, attn: Attention, attn_norm: tuple[torch.Tensor, torch.Tensor], mlp: MLP,
                 mlp_norm: tuple[torch.Tensor, torch.Tensor], eps: float) -> None:
        self.attn, self.attn_norm, self.mlp, self.mlp_norm, self.eps = attn, attn_norm, mlp, mlp_norm, eps

    @classmethod
    def load(cls, src: WeightSource, prefix: str, num_heads: int, head_dim: int, act: str,
             eps: float) -> "PostNormLayer":
        """``q``/``k``/``v``/``o`` and their biases, ``up``/``down`` and theirs, the LayerNorms ``attn_norm`` /
        ``mlp_norm`` (weight and ``_bias``)."""
        qkv, o = Attention.load_projections(src, prefix, bias=True, dense=False)  # (an encoder keeps no copies)
        attn = Attention(qkv, o, num_heads, num_heads, head_dim, head_dim ** -0.5, None, causal=False)
        norm = [(src.norm(prefix + n), src.norm(prefix + n + "_bias")) for n in ("attn_norm", "mlp_norm")]
        return cls(attn, norm[0], MLP.load(src, prefix, act), norm[1], eps)

    def linear_slots(self, prefix: str):
        yield from self.attn.linear_slots(prefix)
        yield from self.mlp.linear_slots(prefix)

    def norms(self) -> dict[str, torch.Tensor]:
        return {"attn_norm": self.attn_norm[0], "attn_norm_bias": self.attn_norm[1], "mlp_norm": self.mlp_norm[0],
                "mlp_norm_bias": self.mlp_norm[1]}

    def forward(self, h: torch.Tensor, x: torch.Tensor, spans: list[tuple[int, int]], ops):
        """h: the residual rows (T, H), x: the same rows as the linears read them (``ops.add_layer_norm``), each
        span a whole text -> the layer's (h, x)."""
        h, x = ops.add_layer_norm(h, self.attn(x, None, None, (None, None), spans, ops), *self.attn_norm, self.eps)
        return ops.add_layer_norm(h, self.mlp(x, ops), *self.mlp_norm, self.eps)

    __call__ = forward
