"""Llama 1-3.x (SmolLM2, Llama 3.2, ...), Mistral (the llama layout; HF ``mistral`` with its sliding window) and
Mixtral (llama with a mixture of experts; llama.cpp writes it as ``llama`` with an expert count).

Llama 3.x rotary scaling: HF's ``rope_type: llama3``; llama.cpp writes the same as per-frequency divisors
(the ``rope_freqs`` tensor)."""

from pagedllm.model.archs import Arch, GGUFMeta


def from_gguf(meta: GGUFMeta) -> dict:
    out = {}
    if meta.kv("expert_count"):
        out |= {"num_experts": int(meta.kv("expert_count")), "num_experts_per_tok": int(meta.kv("expert_used_count")),
                "moe_intermediate_size": int(meta.kv("expert_feed_forward_length", meta.kv("feed_forward_length")))}
    if "rope_freqs.weight" in meta.tensor_names:
        out["rope_scaling"] = {"rope_type": "factors", "factors": [float(f) for f in meta.tensor("rope_freqs.weight")]}
    elif meta.kv("rope.scaling.type") == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(meta.kv("rope.scaling.factor"))}
    return out


def from_hf(hf: dict) -> dict:
    window = hf.get("sliding_window") if hf.get("model_type") in ("mistral", "mixtral") else None
    out = {"sliding_window": window, "layer_types": ("sliding",) * hf["num_hidden_layers"] if window else ()}
    if hf.get("model_type") == "mixtral":
        out |= {"num_experts": hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
                "moe_intermediate_size": hf["intermediate_size"]}
    return out


ARCH = Arch("llama", ("llama", "mistral", "mixtral"), from_gguf, from_hf, gguf_permuted_qk=True)
