"""Ministral 3 (HF ``ministral3``, the text model of Mistral 3; llama.cpp's GGUF name ``mistral3``): Mistral's layers
with YaRN rotary scaling (``rope_parameters``: cos and sin times its attention factor) and Llama 4's attention
temperature, each query times 1 + beta * log(1 + floor(position / original context)) after the rotary (1 below the
original context of 16k, so only long prompts see it).

GGUF files of it are refused for now: how llama.cpp writes its YaRN and temperature keys was not checked against a
file converted by llama.cpp itself (the vendored converter predates the architecture)."""

from pagedllm.model.archs import Arch, GGUFMeta, hf_rope, sliding_everywhere


def from_gguf(meta: GGUFMeta) -> dict:
    raise ValueError("mistral3 (Ministral 3) GGUF files are not supported yet: serve its HF directory")


def from_hf(hf: dict) -> dict:
    _, scaling = hf_rope(hf)
    params = hf.get("rope_parameters") or {}
    out = sliding_everywhere(hf.get("sliding_window"), hf["num_hidden_layers"])
    beta = params.get("llama_4_scaling_beta")
    if beta:
        out |= {"attn_temperature_scale": float(beta),
                "attn_temperature_length": int(params.get("original_max_position_embeddings")
                                               or (scaling or {})["original_max_position_embeddings"])}
    return out


ARCH = Arch("mistral3", ("ministral3",), from_gguf, from_hf)
