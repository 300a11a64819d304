"""Gemma 3 (text): embeddings times sqrt(hidden), RMSNorm with (1 + w) (GGUF files store 1 + w), four norms per
layer, QK-norm, GeGLU (tanh GELU), the query scaled by ``query_pre_attn_scalar ** -0.5``, and 5 sliding-window
layers (their own rotary base, 10000) to 1 global one; ``<end_of_turn>`` ends a turn."""

import math

from pagedllm.model.archs import Arch, GGUFMeta, gguf_linear_rope, hf_rope

PATTERN = 6  # every 6th layer is global (llama.cpp's and transformers' default for Gemma 3)


def _common(hidden: int, layers: int, window: int, pattern: int = PATTERN) -> dict:
    return {"qk_norm": True, "hidden_act": "gelu_tanh", "sandwich_norm": True, "norm_float32": True,
            "embed_scale": math.sqrt(hidden), "sliding_window": window,
            "layer_types": tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers))}


def from_gguf(meta: GGUFMeta) -> dict:
    out = _common(int(meta.kv("embedding_length")), int(meta.kv("block_count")),
                  int(meta.kv("attention.sliding_window", 512)))
    out["rope_local_theta"] = 10000.0  # not in the file: llama.cpp's constant
    if int(meta.kv("block_count")) == 62:  # Gemma 3 27B: llama.cpp's (and the config's) query scale hidden/heads
        out["attn_scale"] = (int(meta.kv("embedding_length")) / int(meta.kv("attention.head_count"))) ** -0.5
    out |= gguf_linear_rope(meta)
    eot = meta.get("tokenizer.ggml.eot_token_id", None)  # the file's say, else the vocabulary's <end_of_turn>
    eot = meta.token_id("<end_of_turn>") if eot is None else eot
    if eot is not None:
        out["stop_token_ids"] = (int(eot),)
    return out


def from_hf(hf: dict) -> dict:
    layers = hf["num_hidden_layers"]
    out = _common(hf["hidden_size"], layers, hf.get("sliding_window", 4096), hf.get("sliding_window_pattern", PATTERN))
    if hf.get("layer_types"):
        out["layer_types"] = tuple("sliding" if t == "sliding_attention" else "full" for t in hf["layer_types"])
    out["rope_theta"], out["rope_scaling"] = hf_rope(hf, "full_attention")
    if "rope_parameters" not in hf and "rope_theta" not in hf:
        out["rope_theta"] = 1e6  # transformers' default for Gemma 3
    out["rope_local_theta"] = hf_rope(hf, "sliding_attention")[0] if "rope_parameters" in hf else float(
        hf.get("rope_local_base_freq", 10000.0))
    out["attn_scale"] = float(hf.get("query_pre_attn_scalar", 256)) ** -0.5
    out["final_logit_softcap"] = hf.get("final_logit_softcapping")
    out["attn_softcap"] = hf.get("attn_logit_softcapping")
    if hf.get("use_bidirectional_attention"):  # EmbeddingGemma: an encoder, no head of its own
        out |= {"encoder": True, "pooling": "mean", "tie_word_embeddings": True}
    return out


ARCH = Arch("gemma3", ("gemma3_text", "gemma3"), from_gguf, from_hf,
            hf_names={"post_attention_layernorm.weight": "attn_out_norm",
                      "pre_feedforward_layernorm.weight": "post_norm",
                      "post_feedforward_layernorm.weight": "mlp_out_norm"},
            hf_norm_plus_one=True)
