"""Megatron-style tensor-parallel sharding of a loaded weights dict (Shoeybi et al. 2019, "Megatron-LM").

Each rank keeps:
- column-parallel ``q``/``k``/``v`` rows by attention head (and their biases), ``gate``/``up`` rows by intermediate
  channel: each rank computes its own heads / channels, no communication;
- row-parallel ``o``/``down`` columns (the same heads / channels as inputs): each rank's output is a partial sum,
  all-reduced once per layer for attention and once for the MLP;
- a vocabulary slice of ``embed`` (lookups outside it give zeros; the ranks' rows are all-reduced) and of
  ``lm_head`` (each rank computes its slice of the logits; they are all-gathered). The vocabulary is padded with
  zero rows up to a multiple of the world size;
- norms whole (replicated).

Where a model has fewer KV heads than ranks, KV heads are replicated: each rank keeps the one KV head its query
heads use (as vLLM does), so the world size must be a multiple of the KV head count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.model.loader import ModelArchConfig


@dataclass(frozen=True)
class TPLayout:
    """What rank ``rank`` of ``world_size`` holds."""

    rank: int
    world_size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    kv_head_start: int  # first KV head (of the whole model) this rank holds
    intermediate_size: int  # MLP channels on this rank
    vocab_per_rank: int  # rows of the (padded) vocabulary on each rank
    vocab_start: int  # first vocabulary id of this rank's slice

    @property
    def padded_vocab_size(self) -> int:
        return self.vocab_per_rank * self.world_size


def tp_layout(cfg: ModelArchConfig, world_size: int, rank: int = 0) -> TPLayout:
    """The per-rank sizes, or a ValueError naming the model's head counts and sizes when they do not divide."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad tensor-parallel rank {rank} of world size {world_size}")
    n, h, kv, inter = world_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    problems = []
    if h % n:
        problems.append(f"{h} query heads are not a multiple of {n}")
    if kv % n and n % kv:
        problems.append(f"{kv} KV heads are neither a multiple nor a divisor of {n}")
    if inter % n:
        problems.append(f"intermediate size {inter} is not a multiple of {n}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={n} does not divide the model ({cfg.arch}: {h} query heads, {kv} KV heads, "
            f"intermediate size {inter}, hidden size {cfg.hidden_size}): " + "; ".join(problems)
            + ". Query heads and the intermediate size must be multiples of the tensor-parallel size; KV heads a "
            "multiple of it, or a divisor of it (then they are replicated)."
        )
    if kv >= n:
        kv_local, kv_start = kv // n, rank * (kv // n)
    else:  # replicated: n // kv consecutive ranks share one KV head, the one their query heads use
        kv_local, kv_start = 1, rank // (n // kv)
    vocab_per_rank = -(-cfg.vocab_size // n)
    return TPLayout(rank, n, h // n, kv_local, kv_start, inter // n, vocab_per_rank, rank * vocab_per_rank)


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


def shard_weights(cfg: ModelArchConfig, weights: dict, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Slice ``weights`` (engine names, as ``model.loader`` returns them) for ``rank``; empties ``weights``."""
    check_shardable(cfg, weights, world_size)
    lay = tp_layout(cfg, world_size, rank)
    d = cfg.head_dim
    q0, q1 = rank * lay.num_heads * d, (rank + 1) * lay.num_heads * d
    k0, k1 = lay.kv_head_start * d, (lay.kv_head_start + lay.num_kv_heads) * d
    i0, i1 = rank * lay.intermediate_size, (rank + 1) * lay.intermediate_size
    row_slices = {"q": (q0, q1), "q_bias": (q0, q1), "k": (k0, k1), "k_bias": (k0, k1), "v": (k0, k1),
                  "v_bias": (k0, k1), "gate": (i0, i1), "up": (i0, i1)}
    col_slices = {"o": (q0, q1), "down": (i0, i1)}
    out: dict[str, torch.Tensor] = {}
    for name in list(weights):
        w = weights.pop(name)
        leaf = name.rsplit(".", 1)[-1]
        if name in ("embed", "lm_head"):
            out[name] = _vocab_slice(w, lay)
        elif name.startswith("layers.") and leaf in row_slices:
            out[name] = _rows(w, *row_slices[leaf])
        elif name.startswith("layers.") and leaf in col_slices:
            out[name] = _cols(w, *col_slices[leaf])
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
