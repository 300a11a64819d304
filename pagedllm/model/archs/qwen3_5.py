"""Qwen 3.5 (dense; llama.cpp's GGUF name ``qwen35``): a hybrid of Gated DeltaNet layers (``layers.gated_deltanet``:
a recurrent state per sequence) and, every ``full_attention_interval``-th layer (4), full attention with QK-norm, a
sigmoid output gate (q's projection holds each head's query and gate rows) and rotary on the first quarter of each
256-wide head. Its RMSNorms multiply by 1 + w (GGUF files store 1 + w), except the DeltaNet's gated norm (w).
Released checkpoints are multimodal (``Qwen3_5ForConditionalGeneration``): the text model is read, the vision
tower skipped. Its mrope sections coincide for text (one position for all three), so the rotary is the plain one.

GGUF files (llama.cpp's converter) store A as -exp(A_log), the convolution as (conv_dim, K), and, where there are
more value heads than key heads, the value heads tiled over the key heads (``linear_v_tiled``)."""

from pagedllm.model.archs import Arch, GGUFMeta, hf_rope

INTERVAL = 4  # transformers' and llama.cpp's default full_attention_interval


def _types(n: int, interval: int, flags=None) -> tuple[str, ...]:
    if flags is not None:  # llama.cpp's per-layer recurrent flags, where the file has them
        return tuple("linear" if f else "full" for f in list(flags)[:n])
    return tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(n))


def from_gguf(meta: GGUFMeta) -> dict:
    n = int(meta.kv("block_count"))
    nv = int(meta.kv("ssm.time_step_rank"))
    head_dim = int(meta.kv("attention.key_length"))
    return {"layer_types": _types(n, int(meta.kv("full_attention_interval", INTERVAL)),
                                  meta.kv("attention.recurrent_layers")),
            "qk_norm": True, "attn_output_gate": True, "norm_float32": True,
            "rotary_dim": int(meta.kv("rope.dimension_count", head_dim // 4)),
            "linear_num_k_heads": int(meta.kv("ssm.group_count")), "linear_num_v_heads": nv,
            "linear_k_head_dim": int(meta.kv("ssm.state_size")),
            "linear_v_head_dim": int(meta.kv("ssm.inner_size")) // nv,
            "linear_conv_kernel": int(meta.kv("ssm.conv_kernel")), "linear_v_tiled": True}


def from_hf(hf: dict) -> dict:
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    params = hf.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % hf.get("full_attention_interval", INTERVAL) == 0
                                      else "linear_attention" for i in range(hf["num_hidden_layers"])]
    return {"layer_types": tuple("linear" if t == "linear_attention" else "full" for t in types),
            "qk_norm": True, "attn_output_gate": True, "norm_float32": True,
            "rope_scaling": hf_rope(hf)[1], "rotary_dim": int(head_dim * factor),
            "linear_num_k_heads": hf["linear_num_key_heads"], "linear_num_v_heads": hf["linear_num_value_heads"],
            "linear_k_head_dim": hf["linear_key_head_dim"], "linear_v_head_dim": hf["linear_value_head_dim"],
            "linear_conv_kernel": hf["linear_conv_kernel_dim"], "linear_v_tiled": False}


def split_hf(rest: str, t) -> dict | None:
    """The DeltaNet's tensors that need more than a name: A_log as A = -exp(A_log) (as GGUF stores it), the
    convolution squeezed to (conv_dim, K)."""
    if rest == "linear_attn.A_log":
        return {"ssm_a": -t.float().exp()}  # (a tensor's own methods: the registry stays free of torch)
    if rest == "linear_attn.conv1d.weight":
        return {"conv": t.float().reshape(t.shape[0], -1)}
    return None


ARCH = Arch("qwen35", ("qwen3_5", "qwen3_5_text"), from_gguf, from_hf,
            gguf_names={"post_attention_norm.weight": "post_norm", "attn_qkv.weight": "qkv", "attn_gate.weight": "z",
                        "ssm_beta.weight": "beta", "ssm_alpha.weight": "alpha", "ssm_conv1d.weight": "conv",
                        "ssm_dt.bias": "dt_bias", "ssm_a": "ssm_a", "ssm_norm.weight": "ssm_normw",
                        "ssm_out.weight": "out"},
            hf_names={"linear_attn.in_proj_qkv.weight": "qkv", "linear_attn.in_proj_z.weight": "z",
                      "linear_attn.in_proj_b.weight": "beta", "linear_attn.in_proj_a.weight": "alpha",
                      "linear_attn.dt_bias": "dt_bias", "linear_attn.norm.weight": "ssm_normw",
                      "linear_attn.out_proj.weight": "out"},
            hf_norm_plus_one=True, split_hf=split_hf)
