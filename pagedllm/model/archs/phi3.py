"""Phi-3 / Phi-3.5 mini: llama with q/k/v and gate/up fused in the checkpoint, and a sliding window on every layer
where the config sets one."""

from pagedllm.model.archs import Arch, GGUFMeta, sliding_everywhere


def from_gguf(meta: GGUFMeta) -> dict:
    return sliding_everywhere(meta.kv("attention.sliding_window"), int(meta.kv("block_count")))


def from_hf(hf: dict) -> dict:
    if (hf.get("rope_scaling") or {}).get("type") in ("longrope", "su") or hf.get("partial_rotary_factor", 1.0) != 1:
        raise ValueError("phi3: long-context rope scaling (longrope) and partial rotary are not supported")
    return sliding_everywhere(hf.get("sliding_window"), hf["num_hidden_layers"])


ARCH = Arch("phi3", ("phi3",), from_gguf, from_hf, gguf_names={"ffn_up.weight": "gate_up"},
            hf_names={"self_attn.qkv_proj.weight": "qkv", "mlp.gate_up_proj.weight": "gate_up"})
