"""Gemma 4 (text; E2B / E4B / 31B): Gemma 3's layers (sandwich norms, QK-norm, GeGLU, scaled embeddings, sliding
and full layers with their own rotary) with plain RMSNorm weights (w, not 1 + w), no query scaling, each v head
RMS-normalised without a weight, full layers with their own head size (and, where ``attention_k_eq_v``, their own
KV heads and values equal to their keys' projection), a ``proportional`` rotary on them (a quarter of the head's
frequencies turn), the last ``num_kv_shared_layers`` layers attending over the K/V of the last earlier layer of
their type (no K/V of their own; their MLPs twice as wide with ``use_double_wide_mlp``), per-layer inputs (PLE,
``layers.per_layer_inputs``), a scalar on each layer's output, and (26B-A4B) the experts beside the dense MLP
(``layers.mlp.DenseAndExperts``). Bidirectional variants are refused by name."""

import math

from pagedllm.model.archs import Arch, GGUFMeta, gguf_experts, hf_rope


def _common(hidden: int) -> dict:
    return {"qk_norm": True, "hidden_act": "gelu_tanh", "sandwich_norm": True, "norm_float32": True,
            "embed_scale": math.sqrt(hidden), "attn_scale": 1.0, "attn_v_norm": True}


def _at(v, i: int) -> int:
    """Entry i of a per-layer GGUF array, or the value itself."""
    return int(v[i]) if hasattr(v, "__len__") and not isinstance(v, str) else int(v)


def from_gguf(meta: GGUFMeta) -> dict:
    layers = int(meta.kv("block_count"))
    sliding = [bool(x) for x in meta.kv("attention.sliding_window_pattern")]
    full = sliding.index(False)
    kv = meta.kv("attention.head_count_kv", meta.kv("attention.head_count"))
    out = _common(int(meta.kv("embedding_length"))) | {
        "layer_types": tuple("sliding" if s else "full" for s in sliding),
        "sliding_window": int(meta.kv("attention.sliding_window")),
        "head_dim": int(meta.kv("attention.key_length_swa")),
        "global_head_dim": int(meta.kv("attention.key_length")),
        "num_kv_heads": _at(kv, sliding.index(True)) if True in sliding else _at(kv, full),
        "global_num_kv_heads": _at(kv, full),
        "kv_shared_layers": int(meta.kv("attention.shared_kv_layers", 0)),
        "per_layer_input_size": int(meta.kv("embedding_length_per_layer_input", 0)),
        "rope_local_theta": float(meta.kv("rope.freq_base_swa", 10000.0)),
        "final_logit_softcap": meta.kv("final_logit_softcapping"),
    }
    if meta.kv("expert_count"):  # 26B-A4B: the experts beside the dense MLP
        out |= gguf_experts(meta) | {"moe_beside_mlp": True}
    if "rope_freqs.weight" in meta.tensor_names:  # the full layers' proportional rotary: 1e30 where none turns
        out["rope_scaling"] = {"rope_type": "factors",
                               "factors": [float(f) for f in meta.tensor("rope_freqs.weight")]}
    if len(sliding) != layers:
        raise ValueError(f"gemma4: {len(sliding)} sliding-window flags for {layers} layers")
    eot = meta.get("tokenizer.ggml.eot_token_id", None)
    eot = meta.token_id("<turn|>") if eot is None else eot
    if eot is not None:
        out["stop_token_ids"] = (int(eot),)
    return out


def _full_layer_value(hf: dict, key: str, default):
    """A full layer's ``per_layer_config`` entry (what transformers serialises), else the top-level key."""
    for i, t in enumerate(hf["layer_types"]):
        entry = (hf.get("per_layer_config") or {}).get(str(i)) or (hf.get("per_layer_config") or {}).get(i) or {}
        if t == "full_attention" and key in entry:
            return entry[key]
    return default


def from_hf(hf: dict) -> dict:
    if hf.get("use_bidirectional_attention") == "all":
        raise ValueError("gemma4: use_bidirectional_attention='all' is not supported")
    out = _common(hf["hidden_size"]) | {
        "layer_types": tuple("sliding" if t == "sliding_attention" else "full" for t in hf["layer_types"]),
        "sliding_window": hf.get("sliding_window", 512),
        "global_head_dim": _full_layer_value(hf, "head_dim", hf.get("global_head_dim", 512)),
        "kv_shared_layers": hf.get("num_kv_shared_layers", 0),
        "per_layer_input_size": hf.get("hidden_size_per_layer_input") or 0,
        "final_logit_softcap": hf.get("final_logit_softcapping"),
    }
    if hf.get("enable_moe_block"):
        out |= {"num_experts": hf["num_experts"], "num_experts_per_tok": hf["top_k_experts"],
                "moe_intermediate_size": hf["moe_intermediate_size"], "moe_beside_mlp": True}
    heads = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
    out["global_num_kv_heads"] = _full_layer_value(hf, "num_key_value_heads", heads) or 0
    if out["per_layer_input_size"] and hf.get("vocab_size_per_layer_input", hf["vocab_size"]) != hf["vocab_size"]:
        raise ValueError("gemma4: a per-layer input vocabulary other than the model's is not supported")
    out["rope_theta"], out["rope_scaling"] = hf_rope(hf, "full_attention")
    out["rope_local_theta"] = hf_rope(hf, "sliding_attention")[0]
    return out


ARCH = Arch("gemma4", ("gemma4_text", "gemma4"), from_gguf, from_hf,
            gguf_names={"inp_gate.weight": "ple_gate", "proj.weight": "ple_out", "post_norm.weight": "ple_norm",
                        "layer_output_scale.weight": "layer_scalar", "ffn_gate_inp.scale": "router_scale",
                        "ffn_down_exps.scale": "expert_scale", "post_ffw_norm_1.weight": "dense_out_norm",
                        "pre_ffw_norm_2.weight": "experts_in_norm", "post_ffw_norm_2.weight": "experts_out_norm"},
            hf_names={"post_attention_layernorm.weight": "attn_out_norm",
                      "pre_feedforward_layernorm.weight": "post_norm",
                      "post_feedforward_layernorm.weight": "mlp_out_norm",
                      "per_layer_input_gate.weight": "ple_gate", "per_layer_projection.weight": "ple_out",
                      "post_per_layer_input_norm.weight": "ple_norm", "layer_scalar": "layer_scalar",
                      "router.proj.weight": "router", "router.scale": "router_scale",
                      "router.per_expert_scale": "expert_scale", "post_feedforward_layernorm_1.weight": "dense_out_norm",
                      "pre_feedforward_layernorm_2.weight": "experts_in_norm",
                      "post_feedforward_layernorm_2.weight": "experts_out_norm"},
            hf_experts="experts.",  # stacked: (E, 2I, H) gate/up and (E, H, I) down
            gguf_global_names={"per_layer_token_embd.weight": "ple_embed", "per_layer_model_proj.weight": "ple_proj",
                               "per_layer_proj_norm.weight": "ple_norm"},
            hf_global_names={"model.embed_tokens_per_layer.weight": "ple_embed",
                             "model.per_layer_model_projection.weight": "ple_proj",
                             "model.per_layer_projection_norm.weight": "ple_norm"})
