"""Granite 4.0-H (IBM): a hybrid of Mamba-2 layers (``layers.mamba2``: a convolution and an SSM state per sequence
instead of K/V) and attention layers, without positional encoding (NoPE) unless the config asks for rotary; every
layer's MLP is a "shared" SwiGLU (plus a top-k mixture of experts on the MoE sizes: Tiny, Small); Granite's
multipliers on the embeddings, the attention scores, each block's output before its residual add, and the logits
(divided). llama.cpp's ``granitehybrid`` GGUF: per-layer KV heads (0 on the Mamba layers), A stored as -exp(A_log),
the norm per group, q/k rows permuted for its rotary."""

from pagedllm.model.archs import Arch, GGUFMeta, gguf_experts, hf_rope


def _mamba(heads: int, head_dim: int, groups: int, state: int) -> dict:
    return {"mamba_heads": heads, "mamba_head_dim": head_dim, "mamba_groups": groups, "mamba_state": state}


def from_gguf(meta: GGUFMeta) -> dict:
    kv = meta.kv("attention.head_count_kv")
    layers = int(meta.kv("block_count"))
    types = tuple("full" if int(kv[i] if hasattr(kv, "__len__") else kv) else "mamba" for i in range(layers))
    heads, inner = int(meta.kv("ssm.time_step_rank")), int(meta.kv("ssm.inner_size"))
    out = {"layer_types": types, **_mamba(heads, inner // heads, int(meta.kv("ssm.group_count")),
                                          int(meta.kv("ssm.state_size"))),
           "linear_conv_kernel": int(meta.kv("ssm.conv_kernel", 4)),
           "embed_scale": float(meta.kv("embedding_scale", 1.0)), "attn_scale": float(meta.kv("attention.scale", 1.0)),
           "residual_scale": float(meta.kv("residual_scale", 1.0)), "logit_scale": float(meta.kv("logit_scale", 1.0))}
    if not meta.kv("rope.scaling.finetuned", False):  # the converter's flag for "uses rotary"
        out["no_rope_layers"] = tuple(range(layers))
    if meta.kv("expert_count"):
        out |= gguf_experts(meta)
        out["intermediate_size"] = int(meta.kv("expert_shared_feed_forward_length"))
    return out


def _number(v) -> float:
    """A config.json number, or transformers' spelling of a non-finite one ({"__float__": "Infinity"})."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def from_hf(hf: dict) -> dict:
    if tuple(map(_number, hf.get("time_step_limit") or (0.0, float("inf")))) != (0.0, float("inf")):
        raise ValueError(f"granitemoehybrid: time_step_limit {hf['time_step_limit']} is not supported")
    layers, hidden = hf["num_hidden_layers"], hf["hidden_size"]
    heads = hf.get("mamba_n_heads", 128)
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = hf.get("mamba_expand", 2) * hidden // heads if head_dim == "auto" else head_dim
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * layers
    out = {"layer_types": tuple("mamba" if t in ("mamba", "linear_attention") else "full" for t in types),
           **_mamba(heads, head_dim, hf.get("mamba_n_groups", 1), hf.get("mamba_d_state", 256)),
           "linear_conv_kernel": hf.get("mamba_d_conv", 4),
           "embed_scale": float(hf.get("embedding_multiplier", 1.0)),
           "attn_scale": float(hf.get("attention_multiplier", 1.0)),
           "residual_scale": float(hf.get("residual_multiplier", 1.0)),
           "logit_scale": float(hf.get("logits_scaling", 1.0)),
           "intermediate_size": hf.get("shared_intermediate_size", 1024)}
    if hf.get("position_embedding_type") != "rope":
        out["no_rope_layers"] = tuple(range(layers))
    else:
        out["rope_theta"], out["rope_scaling"] = hf_rope(hf)
    if hf.get("num_local_experts"):
        out |= {"num_experts": hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
                "moe_intermediate_size": hf["intermediate_size"]}
    return out


# the experts stacked (E, 2I, H) and (E, H, I) as the checkpoints store them (transformers' in-memory names:
# ``hf_experts``)
_STACKED = {"block_sparse_moe.input_linear.weight": "gate_up", "block_sparse_moe.output_linear.weight": "down"}


def _split_hf(rest: str, t):
    """A_log as A; the stacked experts one tensor each."""
    if rest == "mamba.A_log":
        return {"ssm_a": -(t.float().exp())}
    if rest in _STACKED:
        part = _STACKED[rest]
        return {f"experts.{e}.{part}": w for e, w in enumerate(t.unbind(0))}
    return None


ARCH = Arch("granitehybrid", ("granitemoehybrid",), from_gguf, from_hf,
            gguf_names={"ssm_in.weight": "in_proj", "ssm_out.weight": "out", "ssm_conv1d.weight": "conv",
                        "ssm_conv1d.bias": "conv_bias", "ssm_dt.bias": "dt_bias", "ssm_a": "ssm_a", "ssm_d": "ssm_d",
                        "ssm_norm.weight": "ssm_normw"},
            hf_names={"mamba.in_proj.weight": "in_proj", "mamba.out_proj.weight": "out", "mamba.conv1d.weight": "conv",
                      "mamba.conv1d.bias": "conv_bias", "mamba.dt_bias": "dt_bias", "mamba.D": "ssm_d",
                      "mamba.norm.weight": "ssm_normw", "shared_mlp.input_linear.weight": "shared.gate_up",
                      "shared_mlp.output_linear.weight": "shared.down", "block_sparse_moe.router.weight": "router",
                      "block_sparse_moe.router.layer.weight": "router"},
            gguf_permuted_qk=True, split_hf=_split_hf, hf_experts="block_sparse_moe.experts.")
