"""Gemma 2: Gemma 3's layer (embeddings times sqrt(hidden), (1 + w) RMSNorms stored as 1 + w in GGUF files, four
norms per layer, GeGLU) without QK-norm, with soft-capped attention scores (50) and final logits (30), the query
scaled by ``query_pre_attn_scalar ** -0.5``, and sliding-window (4096) and global layers alternating, one rotary
base for both; ``<end_of_turn>`` ends a turn."""

import math

from pagedllm.model.archs import Arch, GGUFMeta


def _common(hidden: int, layers: int, window: int) -> dict:
    return {"hidden_act": "gelu_tanh", "sandwich_norm": True, "norm_float32": True, "embed_scale": math.sqrt(hidden),
            "sliding_window": window,  # even layers slide (transformers' and llama.cpp's layout)
            "layer_types": tuple("sliding" if i % 2 == 0 else "full" for i in range(layers))}


def from_gguf(meta: GGUFMeta) -> dict:
    hidden, heads = int(meta.kv("embedding_length")), int(meta.kv("attention.head_count"))
    out = _common(hidden, int(meta.kv("block_count")), int(meta.kv("attention.sliding_window", 4096)))
    out["attn_softcap"] = float(meta.kv("attn_logit_softcapping", 50.0))
    out["final_logit_softcap"] = float(meta.kv("final_logit_softcapping", 30.0))
    if int(meta.kv("block_count")) == 46:  # Gemma 2 27B: llama.cpp's (and the config's) query scale hidden/heads
        out["attn_scale"] = (hidden / heads) ** -0.5
    eot = meta.get("tokenizer.ggml.eot_token_id", None)
    eot = meta.token_id("<end_of_turn>") if eot is None else eot
    if eot is not None:
        out["stop_token_ids"] = (int(eot),)
    return out


def from_hf(hf: dict) -> dict:
    out = _common(hf["hidden_size"], hf["num_hidden_layers"], hf.get("sliding_window", 4096))
    if hf.get("layer_types"):
        out["layer_types"] = tuple("sliding" if t == "sliding_attention" else "full" for t in hf["layer_types"])
    out["attn_scale"] = float(hf.get("query_pre_attn_scalar", 256)) ** -0.5
    out["attn_softcap"] = hf.get("attn_logit_softcapping")
    out["final_logit_softcap"] = hf.get("final_logit_softcapping")
    return out


ARCH = Arch("gemma2", ("gemma2",), from_gguf, from_hf,
            hf_names={"post_attention_layernorm.weight": "attn_out_norm",
                      "pre_feedforward_layernorm.weight": "post_norm",
                      "post_feedforward_layernorm.weight": "mlp_out_norm"},
            hf_norm_plus_one=True)
