"""Gemma 4's per-layer inputs (PLE): besides the token embedding, each token has a small vector per layer (its
own table of ``num_layers x size`` values a token, plus a projection of the embedded token), and each layer mixes
its vector into the residual stream after the MLP: a gate from the stream, GELU, times the vector, projected back
to the hidden size and RMS-normalised, added. transformers' ``Gemma4TextModel.get_per_layer_inputs`` /
``project_per_layer_inputs`` and the decoder layer's ``per_layer_input_gate`` path, in the same float steps."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class PerLayerInputs:
    """The model's part, once per step: (T,) ids and their embedded rows (T, H) -> (T, layers, size)."""

    def __init__(self, embed, proj, norm: torch.Tensor, num_layers: int, size: int, hidden: int, eps: float) -> None:
        self.embed, self.proj, self.norm = embed, proj, norm
        self.num_layers, self.size, self.hidden, self.eps = num_layers, size, hidden, eps

    @classmethod
    def load(cls, src, cfg) -> "PerLayerInputs":
        """``ple_embed`` (vocab, layers x size; only looked up: a GGUF file's blocks stay in its map, ``BlockRows``,
        as llama.cpp reads the table from its mapped file: the E2B's is 262144 x 8960), ``ple_proj`` (layers x size,
        hidden), ``ple_norm`` (size,)."""
        return cls(src.lookup_table("ple_embed"), src.linear("ple_proj", ["ple_proj"], "mlp"),
                   src.norm("ple_norm"), cfg.num_layers, cfg.per_layer_input_size, cfg.hidden_size, cfg.rms_norm_eps)

    def linear_slots(self):
        yield "ple_embed", self, "embed"
        yield "ple_proj", self, "proj"

    def __call__(self, ids: torch.Tensor, embedded: torch.Tensor, ops) -> torch.Tensor:
        t, shape = ids.shape[0], (ids.shape[0], self.num_layers, self.size)
        dtype = embedded.dtype
        tokens = self.embed.embedding(ids).to(dtype) * torch.tensor(math.sqrt(self.size)).to(dtype)
        proj = self.proj(embedded).to(dtype) * self.hidden ** -0.5
        proj = ops.rms_norm(proj.reshape(t * self.num_layers, self.size).contiguous(), self.norm, self.eps)
        return ((proj.view(shape) + tokens.view(shape)) * 2 ** -0.5).contiguous()


class PerLayerInput:
    """A layer's part: h += norm(out(gelu(gate(h)) * its vector)), in place on the residual stream."""

    def __init__(self, gate, out, norm: torch.Tensor, eps: float) -> None:
        self.gate, self.out, self.norm, self.eps = gate, out, norm, eps

    @classmethod
    def load(cls, src, prefix: str, eps: float) -> "PerLayerInput":
        return cls(src.linear(prefix + "ple_gate", [prefix + "ple_gate"], "mlp"),
                   src.linear(prefix + "ple_out", [prefix + "ple_out"], "mlp"), src.norm(prefix + "ple_norm"), eps)

    def linear_slots(self, prefix: str):
        yield prefix + "ple_gate", self, "gate"
        yield prefix + "ple_out", self, "out"

    def __call__(self, h: torch.Tensor, vector: torch.Tensor, ops) -> None:
        g = F.gelu(self.gate(h).to(h.dtype), approximate="tanh") * vector
        h.add_(ops.rms_norm(self.out(g).to(h.dtype).contiguous(), self.norm, self.eps))
