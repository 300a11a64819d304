"""Llama 1-3.x (SmolLM2, Llama 3.2, ...), Mistral (the llama layout; HF ``mistral`` with its sliding window) and
Mixtral (llama with a mixture of experts; llama.cpp writes it as ``llama`` with an expert count).

Llama 3.x rotary scaling: HF's ``rope_type: llama3``; llama.cpp writes the same as per-frequency divisors
(the ``rope_freqs`` tensor)."""

from pagedllm.model.archs import Arch, GGUFMeta, gguf_experts, gguf_linear_rope, sliding_everywhere


def from_gguf(meta: GGUFMeta) -> dict:
    if "rope_freqs.weight" in meta.tensor_names:
        rope = {"rope_scaling": {"rope_type": "factors",
                                 "factors": [float(f) for f in meta.tensor("rope_freqs.weight")]}}
    else:
        rope = gguf_linear_rope(meta)
    return gguf_experts(meta) | rope


def from_hf(hf: dict) -> dict:
    window = hf.get("sliding_window") if hf.get("model_type") in ("mistral", "mixtral") else None
    out = sliding_everywhere(window, hf["num_hidden_layers"])
    if hf.get("model_type") == "mixtral":
        out |= {"num_experts": hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
                "moe_intermediate_size": hf["intermediate_size"]}
    return out


# Mixtral's router and experts (w1 / w3 / w2) under ``block_sparse_moe``
ARCH = Arch("llama", ("llama", "mistral", "mixtral"), from_gguf, from_hf, gguf_permuted_qk=True,
            hf_names={"block_sparse_moe.gate.weight": "router"}, hf_experts="block_sparse_moe.experts.")
