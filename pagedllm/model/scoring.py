"""Whole-sequence forward passes for offline tools (calibration, perplexity): one sequence at a time through the
model's normal prefill path, with a private KV cache just large enough for it."""

from __future__ import annotations

import math

import torch

from pagedllm.layers.attention import AttentionMetadata, PrefillSeq
from pagedllm.layers.gated_deltanet import StatePrefill, StateMetadata

BLOCK = 16


@torch.inference_mode()
def sequence_hidden(model, token_ids: list[int]) -> torch.Tensor:
    """Final hidden states (L, H) of ``token_ids`` run as one prefill."""
    cfg, dev = model.cfg, model.device
    n = len(token_ids)
    nb = math.ceil(n / BLOCK)
    caches = []  # per layer its own (K, V), or the layer's whose K/V it reads (Gemma 4's last layers)
    for i in range(cfg.num_layers):
        shape = (nb, BLOCK, cfg.layer_kv_heads(i), cfg.layer_head_dim(i))
        caches.append(caches[cfg.kv_source(i)] if cfg.kv_source(i) != i else
                      tuple(torch.zeros(shape, dtype=model.kv_dtype, device=dev) for _ in range(2)))
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=dev), decode_rows=None, decode_block_tables=None,
                             decode_mask=None, num_decodes=0,
                             prefills=[PrefillSeq(0, n, n, torch.arange(nb, device=dev))])
    states = None
    if cfg.hybrid_state:  # one zeroed state slot per state layer, the sequence its only prefill
        for i in cfg.state_layers():
            caches[i] = tuple(torch.zeros((1, *shape), dtype=torch.float32 if f32 else model.dtype, device=dev)
                              for shape, f32 in model.layers[i].attn.state_shapes())
        states = StateMetadata(None, torch.zeros(0, dtype=torch.long, device=dev), 0, [StatePrefill(0, n, 0)],
                               torch.tensor([[0, n, 0, 0, -1]], dtype=torch.long, device=dev))
    ids = torch.tensor(token_ids, device=dev)
    return model.forward(ids, torch.arange(n, device=dev), caches, meta, states)


@torch.inference_mode()
def sequence_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """Log-softmax over the vocabulary after each position: (L, V) float32 on the CPU."""
    hidden = sequence_hidden(model, token_ids)
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1).cpu()
