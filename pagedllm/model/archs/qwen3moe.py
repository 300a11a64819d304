"""Qwen 3 mixture of experts (Qwen3-30B-A3B, ...): qwen3's attention, every layer's MLP a softmax-routed top-k
mixture of experts (no shared expert)."""

from pagedllm.model.archs import Arch, GGUFMeta, gguf_experts, no_sliding_window


def from_gguf(meta: GGUFMeta) -> dict:
    experts = gguf_experts(meta)
    if not experts:
        raise ValueError("qwen3moe: the file gives no qwen3moe.expert_count")
    return {"qk_norm": True, "norm_topk_prob": True} | experts


def from_hf(hf: dict) -> dict:
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ValueError("qwen3moe: dense layers between the sparse ones (decoder_sparse_step, mlp_only_layers) "
                         "are not supported")
    return no_sliding_window(hf) | {"qk_norm": True, "num_experts": hf.get("num_experts") or hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf["moe_intermediate_size"],
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "attention_bias": bool(hf.get("attention_bias", False))}


# the router and experts of Qwen's mixtures (Qwen3-MoE, Qwen 3.5 MoE, Qwen3-Next)
HF_MOE_NAMES = {"mlp.gate.weight": "router"}
HF_EXPERTS = "mlp.experts."

ARCH = Arch("qwen3moe", ("qwen3_moe",), from_gguf, from_hf, hf_names=HF_MOE_NAMES, hf_experts=HF_EXPERTS)
