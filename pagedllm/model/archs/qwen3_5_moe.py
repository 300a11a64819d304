"""Qwen 3.5 MoE (35B-A3B; llama.cpp's GGUF name ``qwen35moe``): Qwen 3.5's hybrid layers (``qwen3_5``: Gated
DeltaNet and gated attention) with every MLP a mixture of experts (softmax router, top 8 of 256 renormalised) plus a
shared expert whose output is scaled by sigmoid(x . shared_expert_gate) (``layers.mlp.MoE``)."""

from pagedllm.model.archs import Arch, GGUFMeta, gguf_experts
from pagedllm.model.archs import qwen3_5 as dense
from pagedllm.model.archs import qwen3moe


def from_gguf(meta: GGUFMeta) -> dict:
    experts = gguf_experts(meta)
    if not experts:
        raise ValueError("qwen35moe: the file gives no qwen35moe.expert_count")
    return dense.from_gguf(meta) | experts | {
        "shared_expert_intermediate_size": int(meta.kv("expert_shared_feed_forward_length", 0))}


def from_hf(hf: dict) -> dict:
    return dense.from_hf(hf) | {"num_experts": hf["num_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
                                "moe_intermediate_size": hf["moe_intermediate_size"], "norm_topk_prob": True,
                                "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 0)}


# the router, and the shared expert and its gate
HF_MOE_NAMES = qwen3moe.HF_MOE_NAMES | {
    "mlp.shared_expert.gate_proj.weight": "shared.gate", "mlp.shared_expert.up_proj.weight": "shared.up",
    "mlp.shared_expert.down_proj.weight": "shared.down", "mlp.shared_expert_gate.weight": "shared_gate"}

ARCH = Arch("qwen35moe", ("qwen3_5_moe", "qwen3_5_moe_text"), from_gguf, from_hf, gguf_names=dense.ARCH.gguf_names,
            hf_names=dense.ARCH.hf_names | HF_MOE_NAMES, hf_norm_plus_one=True, split_hf=dense.split_hf,
            hf_experts=qwen3moe.HF_EXPERTS)
