"""Ministral 3 (HF ``ministral3``, the text model of Mistral 3; llama.cpp's GGUF name ``mistral3``): Mistral's layers
with YaRN rotary scaling (``rope_parameters``: cos and sin times its attention factor) and Llama 4's attention
temperature, each query times 1 + beta * log(1 + floor(position / original context)) after the rotary (1 below the
original context of 16k, so only long prompts see it).

GGUF files as llama.cpp's converter writes them (``conversion/mistral3.py``: the llama layout, q/k rows permuted for
its rotary): YaRN's factor, original context and betas under ``rope.scaling``, ``mscale_all_dim`` as
``rope.scaling.yarn_log_multiplier`` (llama.cpp takes ``mscale`` as 1), the temperature's beta as
``attention.temperature_scale`` with the original context as its length. Checked against a file that converter wrote
(llama-cpp-python 0.3.36's vendored source) from a tiny transformers model, and in the tests against files written
the same way."""

from pagedllm.model.archs import Arch, GGUFMeta, hf_rope, sliding_everywhere


def from_gguf(meta: GGUFMeta) -> dict:
    out: dict = {}
    original = meta.kv("rope.scaling.original_context_length")
    if meta.kv("rope.scaling.type") == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(meta.kv("rope.scaling.factor")),
                   "original_max_position_embeddings": int(original),
                   "beta_fast": float(meta.kv("rope.scaling.yarn_beta_fast", 32.0)),
                   "beta_slow": float(meta.kv("rope.scaling.yarn_beta_slow", 1.0))}
        if meta.kv("rope.scaling.yarn_log_multiplier"):  # transformers' attention factor from mscale 1 and this
            scaling |= {"mscale": 1.0, "mscale_all_dim": float(meta.kv("rope.scaling.yarn_log_multiplier"))}
        if meta.kv("rope.scaling.yarn_attn_factor") is not None:
            scaling["attention_factor"] = float(meta.kv("rope.scaling.yarn_attn_factor"))
        out["rope_scaling"] = scaling
    beta = meta.kv("attention.temperature_scale")
    if beta:
        if not original:
            raise ValueError("mistral3: attention.temperature_scale without rope.scaling.original_context_length")
        out |= {"attn_temperature_scale": float(beta), "attn_temperature_length": int(original)}
    return out


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


ARCH = Arch("mistral3", ("ministral3",), from_gguf, from_hf, gguf_permuted_qk=True)
