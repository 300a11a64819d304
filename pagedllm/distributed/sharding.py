"""Megatron-style tensor-parallel sharding of a loaded weights dict (Shoeybi et al. 2019, "Megatron-LM").

Each rank keeps (as the layer classes declare it of their weights: ``TP_SPLIT`` of ``layers.attention.Attention``
and ``layers.mlp.GatedMLP``, passed in by the runner):
- column-parallel ``q``/``k``/``v`` rows by attention head (and their biases), ``gate``/``up`` rows by intermediate
  channel: each rank computes its own heads / channels, no communication;
- row-parallel ``o``/``down`` columns (the same heads / channels as inputs): each rank's output is a partial sum,
  all-reduced once per layer for attention and once for the MLP; their biases ("first") on rank 0 only (zeros
  elsewhere), so the sum adds them once;
- per-head values (attention sinks) by query head;
- a vocabulary slice of ``embed`` (lookups outside it give zeros; the ranks' rows are all-reduced) and of
  ``lm_head`` (each rank computes its slice of the logits; they are all-gathered). The vocabulary is padded with
  zero rows up to a multiple of the world size;
- norms whole (replicated).

Where a model has fewer KV heads than ranks, KV heads are replicated: each rank keeps the one KV head its query
heads use (as vLLM does), so the world size must be a multiple of the KV head count.
"""

from __future__ import annotations

import torch

from pagedllm.model.arch import ModelArchConfig, TPLayout, tp_layout


def _rows(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return t[start:end].clone()  # a copy: a view would keep the whole tensor's storage alive


def _cols(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return t[:, start:end].contiguous()


def check_shardable(cfg: ModelArchConfig, weights: dict, world_size: int) -> None:
    """Raise ValueError (before any worker starts) when ``weights`` cannot be split ``world_size`` ways.

    Weights that are already quantized (a pre-quantized checkpoint, GGUF blocks kept packed) are refused: quantize
    after sharding instead (the on-the-fly schemes do, since the model quantizes the float shard it is given)."""
    tp_layout(cfg, world_size)
    packed = sorted(k for k, v in weights.items() if not isinstance(v, torch.Tensor))
    if packed:
        raise ValueError(
            f"tensor parallelism cannot shard pre-quantized weights yet ({len(packed)} packed, e.g. {packed[0]!r}): "
            f"load the full-precision model and quantize at load time (int8 / fp8), or use tensor_parallel_size=1")
    fused = sorted(k for k in weights if k.endswith((".qkv", ".gate_up", ".qkv_bias")))
    if fused:
        raise ValueError(f"tensor parallelism needs separate q/k/v and gate/up weights, got fused {fused[0]!r}")


def shard_weights(cfg: ModelArchConfig, weights: dict, rank: int, world_size: int,
                  splits: dict[str, tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Slice ``weights`` (engine names, as ``model.loader`` returns them) for ``rank``; empties ``weights``.
    ``splits``: what the layers declare of their weights, by name in the layer (``layers.{i}.NAME``): ("rows" or
    "cols", "heads" / "kv_heads" / "intermediate" / "head_values": one value per query head), or ("first", "")
    (rank 0 keeps it, the others zeros: a row-parallel output's bias), e.g. ``model.decoder.TP_SPLIT``; other layer
    weights (norms) are replicated."""
    check_shardable(cfg, weights, world_size)
    lay = tp_layout(cfg, world_size, rank)
    d = cfg.head_dim
    spans = {"heads": (rank * lay.num_heads * d, (rank + 1) * lay.num_heads * d),
             "kv_heads": (lay.kv_head_start * d, (lay.kv_head_start + lay.num_kv_heads) * d),
             "intermediate": (rank * lay.intermediate_size, (rank + 1) * lay.intermediate_size),
             "head_values": (rank * lay.num_heads, (rank + 1) * lay.num_heads)}
    out: dict[str, torch.Tensor] = {}
    for name in list(weights):
        w = weights.pop(name)
        leaf = name.rsplit(".", 1)[-1]
        if name in ("embed", "lm_head"):
            out[name] = _vocab_slice(w, lay)
        elif name.startswith("layers.") and leaf in splits:
            how, span = splits[leaf]
            if how == "first":
                out[name] = w if rank == 0 else torch.zeros_like(w)
            else:
                out[name] = (_rows if how == "rows" else _cols)(w, *spans[span])
        else:  # norms: replicated
            out[name] = w
        del w
    return out


def _vocab_slice(w: torch.Tensor, lay: TPLayout) -> torch.Tensor:
    """This rank's rows of an embedding / LM head table, zero-padded to ``vocab_per_rank`` rows."""
    start, end = lay.vocab_start, lay.vocab_start + lay.vocab_per_rank
    part = _rows(w, start, min(end, w.shape[0]))
    if part.shape[0] < lay.vocab_per_rank:
        pad = part.new_zeros(lay.vocab_per_rank - part.shape[0], *part.shape[1:])
        part = torch.cat([part, pad])
    return part
