"""A multi-token prediction (MTP) module, as Qwen 3.5 and Qwen3-Next checkpoints ship one (``mtp.*`` tensors; the
speculative proposer ``spec.proposer.MTPProposer`` drafts with it).

At position p it reads the model's final hidden state there (after the final norm) and the embedding of the token
at p + 1, normalises each, projects their concatenation back to the hidden size (``fc``), runs one decoder layer
shaped as the model's full-attention layers (its own K/V, in the model's KV blocks beside the model's layers) and
its own final norm, and the model's LM head gives the token at p + 2. Its output, normalised, stands in for the
model's hidden state at p + 1 when it drafts further. The embedding and LM head are the model's (shared, not
copied), as in vLLM's and SGLang's Qwen 3.5 MTP."""

from __future__ import annotations

import dataclasses

import torch

from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.linear import tensor_bytes
from pagedllm.layers.weights import LinearBuild, WeightSource
from pagedllm.model.decoder import CausalLM

PREFIX = "mtp."


def pop_mtp_weights(weights) -> dict:
    """Takes the MTP module's tensors out of ``weights`` (named as ``model.loader`` names them: ``mtp.fc``,
    ``mtp.layers.0.qkv``, ...)."""
    return {k[len(PREFIX):]: weights.pop(k) for k in [k for k in weights if k.startswith(PREFIX)]}


class MTPHead:
    def __init__(self, target: CausalLM, weights: dict, build: LinearBuild | None = None) -> None:
        """``weights``: ``pop_mtp_weights``' (taken); ``target``: the model whose embedding and head it shares."""
        cfg = target.cfg
        if target.tp is not None:
            raise ValueError("MTP speculation with tensor parallelism is not supported yet (the module would need "
                             "the whole vocabulary's head on rank 0)")
        n = len({k.split(".")[1] for k in weights if k.startswith("layers.")})
        if n != 1:
            raise ValueError(f"the checkpoint's MTP module has {n} layers; one is supported (Qwen 3.5's)")
        if cfg.layer_types and "full" not in cfg.layer_types:
            raise ValueError("an MTP layer is shaped as the model's full-attention layers, and it has none")
        # one full-attention layer, the model's own kind (its head sizes, rotary, QK-norm, output gate, MLP or MoE)
        self.cfg = dataclasses.replace(cfg, num_layers=1, layer_types=("full",) if cfg.layer_types else (),
                                       no_rope_layers=(), first_dense_layers=0, kv_shared_layers=0)
        src = WeightSource(weights, target.device, target.dtype, build or LinearBuild(), cfg.norm_float32)
        self.embed_norm, self.hidden_norm = src.norm("embed_norm"), src.norm("hidden_norm")
        self.fc = src.linear("fc", ["fc"], "mlp")
        self.model = CausalLM(self.cfg, weights, target.device, target.dtype, build, kv_dtype=target.kv_dtype,
                              shares_with=target)
        self.target = target
        if weights:
            raise ValueError(f"unexpected MTP tensors: {sorted(weights)[:5]}")

    def weight_bytes(self) -> int:
        """Its own weights (the shared embedding and head not counted)."""
        return tensor_bytes([self.embed_norm, self.hidden_norm, *self.fc.tensors()]) + self.model.weight_bytes()

    @torch.inference_mode()
    def forward(self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """next_ids: the token after each row's position (T,); hidden: the model's final (normalised) hidden state
        at each position (T, H), or this module's own output for a position it drafted -> its output (T, H),
        normalised, for ``compute_logits``."""
        ops, eps = self.model.ops, self.cfg.rms_norm_eps
        e = ops.rms_norm(self.model._embed(next_ids), self.embed_norm, eps)
        g = ops.rms_norm(hidden.to(e.dtype), self.hidden_norm, eps)
        return self.model.forward(next_ids, positions, kv_caches, meta, h=self.fc(torch.cat([e, g], dim=-1)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)
