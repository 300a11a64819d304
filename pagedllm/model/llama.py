"""Llama-family decoder (llama: SmolLM2; qwen2: adds q/k/v biases) over flat token batches and a paged KV cache.

The step's tokens of all sequences are one flat (T, hidden) batch: every linear layer runs once per step for the
whole batch; only attention looks at sequence boundaries (through ``AttentionMetadata``). q/k/v and gate/up
projections are fused into one matmul each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.attention import AttentionMetadata, paged_attention
from pagedllm.layers.norm import rms_norm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.model.loader import ModelArchConfig


class LlamaForCausalLM:
    def __init__(self, cfg: ModelArchConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        """Takes (and empties) ``weights``, named as ``model.loader`` names them."""
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.scale = cfg.head_dim ** -0.5

        def take(name: str) -> torch.Tensor:
            # pop: each loaded array is released as soon as it is placed (fused), so loading peaks near one
            # copy of the weights instead of two
            if name not in weights:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            return weights.pop(name).to(device=device, dtype=dtype).contiguous()

        self.embed = take("embed")  # (V, H)
        self.norm = take("norm")
        self.lm_head = self.embed if cfg.tie_word_embeddings else take("lm_head")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            layer = {
                "input_norm": take(p + "input_norm"),
                "post_norm": take(p + "post_norm"),
                "qkv": torch.cat([take(p + "q"), take(p + "k"), take(p + "v")], dim=0),  # (Q+2K, H)
                "o": take(p + "o"),
                "gate_up": torch.cat([take(p + "gate"), take(p + "up")], dim=0),  # (2I, H)
                "down": take(p + "down"),
            }
            if cfg.attention_bias:
                layer["qkv_bias"] = torch.cat([take(p + "q_bias"), take(p + "k_bias"), take(p + "v_bias")])
            self.layers.append(layer)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, device, dtype)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for t in [self.embed, self.norm, self.lm_head] + [w for l in self.layers for w in l.values()]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, H)."""
        cfg = self.cfg
        t = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)  # (T, H)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = rms_norm(h, layer["input_norm"], cfg.rms_norm_eps)
            qkv = F.linear(x, layer["qkv"], layer.get("qkv_bias"))  # (T, Q+2K)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.rotary(positions, q.view(t, cfg.num_heads, cfg.head_dim))
            k = self.rotary(positions, k.view(t, cfg.num_kv_heads, cfg.head_dim))
            v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # (T, Hq, D)
            h = h + F.linear(attn.reshape(t, self.q_size), layer["o"])
            x = rms_norm(h, layer["post_norm"], cfg.rms_norm_eps)
            gate, up = F.linear(x, layer["gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer["down"])
        return rms_norm(h, self.norm, cfg.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()
