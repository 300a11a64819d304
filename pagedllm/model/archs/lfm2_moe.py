"""LFM2-MoE (Liquid AI's 8B-A1B; llama.cpp's GGUF name ``lfm2moe``): LFM2's hybrid layers (``lfm2``: gated short
convolutions and attention with QK-norm) whose MLPs, after the first ``num_dense_layers`` dense ones, are mixtures
of experts routed by sigmoid scores: the top k chosen by score plus a per-expert bias, their scores renormalised and
times ``routed_scaling_factor`` (``layers.mlp.MoE`` with ``scoring="sigmoid"``)."""

from pagedllm.model.archs import Arch, GGUFMeta, gguf_experts
from pagedllm.model.archs import lfm2

SIGMOID = 2  # llama.cpp's expert_gating_func for sigmoid scores


def from_gguf(meta: GGUFMeta) -> dict:
    experts = gguf_experts(meta)
    if not experts:
        raise ValueError("lfm2moe: the file gives no lfm2moe.expert_count")
    return lfm2.from_gguf(meta) | experts | {
        "first_dense_layers": int(meta.kv("leading_dense_block_count", 0)),
        "moe_scoring": "sigmoid" if int(meta.kv("expert_gating_func", SIGMOID)) == SIGMOID else "softmax",
        "norm_topk_prob": bool(meta.kv("expert_weights_norm", True)),
        "moe_routed_scale": float(meta.kv("expert_weights_scale", 1.0))}


def from_hf(hf: dict) -> dict:
    return lfm2.from_hf(hf) | {
        "intermediate_size": hf["intermediate_size"], "num_experts": hf["num_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"], "moe_intermediate_size": hf["moe_intermediate_size"],
        "first_dense_layers": hf.get("num_dense_layers", 0), "moe_scoring": "sigmoid",
        "norm_topk_prob": hf.get("norm_topk_prob", True), "moe_routed_scale": float(hf.get("routed_scaling_factor", 1.0))}


ARCH = Arch("lfm2moe", ("lfm2_moe",), from_gguf, from_hf,
            gguf_names=lfm2.ARCH.gguf_names | {"exp_probs_b.bias": "expert_bias"},
            gguf_global_names=lfm2.ARCH.gguf_global_names,
            hf_names=lfm2.ARCH.hf_names | {"feed_forward.gate.weight": "router", "feed_forward.expert_bias": "expert_bias"},
            hf_global_names=lfm2.ARCH.hf_global_names, hf_experts="feed_forward.experts.")
