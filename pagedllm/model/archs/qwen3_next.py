"""Qwen3-Next (80B-A3B; llama.cpp's GGUF name ``qwen3next``): Qwen 3.5 MoE's layers (``qwen3_5_moe``: Gated DeltaNet
and gated attention, every MLP a mixture of experts with a gated shared expert) in an earlier layout: the
DeltaNet's projections interleaved per key head (``in_proj_qkvz``: q, k, v, z; ``in_proj_ba``: b, a), reordered at
load (``layers.gated_deltanet.GatedDeltaNet.load``). llama.cpp's converter splits qkvz into ``attn_qkv`` and
``attn_gate`` itself (value heads grouped, not tiled) and keeps ``ssm_ba`` interleaved."""

from pagedllm.model.archs import Arch, GGUFMeta
from pagedllm.model.archs import qwen3_5, qwen3_5_moe


def from_gguf(meta: GGUFMeta) -> dict:
    return qwen3_5_moe.from_gguf(meta) | {"linear_v_tiled": False}


def from_hf(hf: dict) -> dict:
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError("qwen3_next: dense MLP layers among the experts (mlp_only_layers, decoder_sparse_step) are "
                         "not supported")
    return qwen3_5_moe.from_hf(hf)


ARCH = Arch("qwen3next", ("qwen3_next",), from_gguf, from_hf,
            gguf_names=qwen3_5.ARCH.gguf_names | {"ssm_ba.weight": "ba", "ssm_in.weight": "qkvz"},
            hf_names=qwen3_5.ARCH.hf_names | qwen3_5_moe.HF_MOE_NAMES | {"linear_attn.in_proj_qkvz.weight": "qkvz",
                                                                      "linear_attn.in_proj_ba.weight": "ba"},
            hf_norm_plus_one=True, split_hf=qwen3_5.split_hf, hf_experts=qwen3_5_moe.ARCH.hf_experts)
