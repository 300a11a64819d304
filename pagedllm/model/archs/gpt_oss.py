"""gpt-oss (OpenAI's open-weight MoE; llama.cpp's GGUF name ``gpt-oss``): attention with q/k/v/o biases, a learned
sink logit per query head in every softmax, sliding-window (128) and full layers alternating, YaRN rotary without
truncating its blend range, and every layer's MLP a mixture of experts: a router with a bias, a softmax over the top
k logits, experts with biases and a clamped SwiGLU (``swiglu_oai``: gate clamped above at 7, up at +-7,
gate * sigmoid(1.702 gate) * (up + 1)).

HF directories keep the experts stacked, transposed and with gate and up interleaved (``gate_up_proj`` (E, H, 2I):
gate the even columns), or, as released, in MXFP4 (``gate_up_proj_blocks`` / ``_scales``: (E, 2I, ...) rows, gate
the even ones); ``split_hf`` gives each expert's rows (MXFP4 ones as ``..._blocks`` / ``..._scales`` pairs, which
the loader decodes to the block kernel's form). GGUF files (llama.cpp's converter) keep them stacked
per layer (``ffn_{gate,up,down}_exps`` with their biases), usually in MXFP4 blocks."""

from pagedllm.model.archs import Arch, GGUFMeta, gguf_experts, hf_rope

ALPHA, LIMIT = 1.702, 7.0  # the clamped SwiGLU's constants (``layers.ops.SWIGLU_OAI_*``), as every release has them
SWA_PATTERN = 2  # llama.cpp's and transformers' default: even layers slide, odd ones see everything


def _common(layers: int, window: int, layer_types=None) -> dict:
    types = layer_types or ["sliding_attention" if (i + 1) % SWA_PATTERN else "full_attention" for i in range(layers)]
    return {"hidden_act": "swiglu_oai", "attn_sinks": True, "norm_topk_prob": True, "sliding_window": window,
            "layer_types": tuple("sliding" if t == "sliding_attention" else "full" for t in types)}


def from_gguf(meta: GGUFMeta) -> dict:
    experts = gguf_experts(meta)
    if not experts:
        raise ValueError("gpt-oss: the file gives no gpt-oss.expert_count")
    out = _common(int(meta.kv("block_count")), int(meta.kv("attention.sliding_window", 128))) | experts
    # harmony ends a turn with <|return|> and a tool call with <|call|> (not <|end|>, which ends a message inside it):
    # stop tokens by their text, as llama.cpp finds them, whatever the file's eos says
    eos, eot = meta.get("tokenizer.ggml.eos_token_id", None), meta.get("tokenizer.ggml.eot_token_id", None)
    stops = [eot] + [meta.token_id(t) for t in ("<|return|>", "<|call|>")]
    stops = list(dict.fromkeys(int(i) for i in stops if i is not None and i != eos))
    if stops:
        out["stop_token_ids"] = tuple(stops)
    if meta.kv("rope.scaling.type") == "yarn":  # gpt-oss's blend range is not truncated (transformers' truncate False)
        out["rope_scaling"] = {"rope_type": "yarn", "factor": float(meta.kv("rope.scaling.factor")),
                               "original_max_position_embeddings": int(meta.kv("rope.scaling.original_context_length")),
                               "beta_fast": float(meta.kv("rope.scaling.yarn_beta_fast", 32.0)),
                               "beta_slow": float(meta.kv("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
        if meta.kv("rope.scaling.yarn_attn_factor") is not None:
            out["rope_scaling"]["attention_factor"] = float(meta.kv("rope.scaling.yarn_attn_factor"))
    return out


def from_hf(hf: dict) -> dict:
    if (hf.get("swiglu_alpha", ALPHA), hf.get("swiglu_limit", LIMIT)) != (ALPHA, LIMIT):
        raise ValueError(f"gpt_oss: swiglu_alpha {hf.get('swiglu_alpha')} / swiglu_limit {hf.get('swiglu_limit')} "
                         f"differ from the released {ALPHA} / {LIMIT}, which the layers implement")
    if (hf.get("quantization_config") or {}).get("quant_method") not in (None, "mxfp4"):
        raise ValueError(f"gpt_oss: quantization {hf['quantization_config'].get('quant_method')!r} is not supported")
    out = _common(hf["num_hidden_layers"], hf.get("sliding_window") or 128, hf.get("layer_types"))
    out["rope_scaling"] = hf_rope(hf)[1]
    return out | {"num_experts": hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
                  "moe_intermediate_size": hf["intermediate_size"]}


def split_hf(rest: str, t) -> dict | None:
    """A layer's stacked expert tensor (``rest``: its name after ``model.layers.{i}.``) as each expert's rows, named
    as ``model.loader`` names them; None: not one of them."""
    part = {"mlp.experts.gate_up_proj": "", "mlp.experts.gate_up_proj_bias": "_bias",
            "mlp.experts.down_proj": "", "mlp.experts.down_proj_bias": "_bias",
            "mlp.experts.gate_up_proj_blocks": "_blocks", "mlp.experts.gate_up_proj_scales": "_scales",
            "mlp.experts.down_proj_blocks": "_blocks", "mlp.experts.down_proj_scales": "_scales"}.get(rest)
    if part is None:
        return None
    out = {}
    for e, w in enumerate(t.unbind(0)):
        if part == "":
            w = w.T  # (H, 2I) or (I, H) as x @ w computes it: rows are output features after the transpose
        # (MXFP4 blocks and scales are stored with output rows first already)
        if "gate_up" in rest:  # interleaved: gate the even rows, up the odd ones
            out[f"experts.{e}.gate{part}"], out[f"experts.{e}.up{part}"] = w[0::2], w[1::2]
        else:
            out[f"experts.{e}.down{part}"] = w
    return out


ARCH = Arch("gpt-oss", ("gpt_oss",), from_gguf, from_hf,
            gguf_names={"post_attention_norm.weight": "post_norm", "attn_sinks.weight": "sinks",
                        "ffn_gate_inp.bias": "router_bias"},
            hf_names={"mlp.router.weight": "router", "mlp.router.bias": "router_bias", "self_attn.sinks": "sinks"},
            split_hf=split_hf)
