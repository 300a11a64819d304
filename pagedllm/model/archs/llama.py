"""Llama 1-3.x (SmolLM2, Llama 3.2, ...) and Mistral (the llama layout; HF ``mistral`` with its sliding window).

Llama 3.x rotary scaling: HF's ``rope_type: llama3``; llama.cpp writes the same as per-frequency divisors
(the ``rope_freqs`` tensor)."""

from pagedllm.model.archs import Arch, GGUFMeta


def from_gguf(meta: GGUFMeta) -> dict:
    out = {}
    if "rope_freqs.weight" in meta.tensor_names:
        out["rope_scaling"] = {"rope_type": "factors", "factors": [float(f) for f in meta.tensor("rope_freqs.weight")]}
    elif meta.kv("rope.scaling.type") == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(meta.kv("rope.scaling.factor"))}
    return out


def from_hf(hf: dict) -> dict:
    window = hf.get("sliding_window") if hf.get("model_type") == "mistral" else None
    return {"sliding_window": window, "layer_types": ("sliding",) * hf["num_hidden_layers"] if window else ()}


ARCH = Arch("llama", ("llama", "mistral"), from_gguf, from_hf, gguf_permuted_qk=True)
