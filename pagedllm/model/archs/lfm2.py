"""LFM2 (Liquid AI; llama.cpp's GGUF name ``lfm2``): a hybrid of gated short-convolution layers
(``layers.short_conv``: out_proj(C * conv(B * x)), its last 2 inputs kept per sequence instead of K/V) and attention
layers with QK-norm; SwiGLU MLPs (w1 gate, w3 up, w2 down) whose size the HF config gives before its "auto adjust"
(2/3, times the multiplier, rounded up to a multiple); plain RMSNorms; the final norm named ``embedding_norm``
(GGUF ``token_embd_norm``); the head tied to the embedding. llama.cpp's files give the KV heads per layer (0 on the
convolution layers), which is where their layer types come from."""

from pagedllm.model.archs import Arch, GGUFMeta


def _ff_dim(hf: dict) -> int:
    """The MLP's width as transformers' ``Lfm2MLP`` and llama.cpp's converter compute it."""
    ff = hf.get("block_ff_dim") or hf["intermediate_size"]
    if hf.get("block_auto_adjust_ff_dim", True):
        ff = int(2 * ff / 3)
        if hf.get("block_ffn_dim_multiplier") is not None:
            ff = int(hf["block_ffn_dim_multiplier"] * ff)
        m = hf.get("block_multiple_of", 256)
        ff = m * ((ff + m - 1) // m)
    return ff


def from_gguf(meta: GGUFMeta) -> dict:
    kv = meta.kv("attention.head_count_kv")
    per_layer = list(kv) if hasattr(kv, "__len__") else [kv] * int(meta.kv("block_count"))
    return {"layer_types": tuple("conv" if int(n) == 0 else "full" for n in per_layer), "qk_norm": True,
            "linear_conv_kernel": int(meta.kv("shortconv.l_cache", 3))}


def from_hf(hf: dict) -> dict:
    types = hf.get("layer_types") or ["full_attention" if i in hf.get("full_attn_idxs", ()) else "conv"
                                      for i in range(hf["num_hidden_layers"])]
    return {"layer_types": tuple("conv" if t == "conv" else "full" for t in types), "qk_norm": True,
            "linear_conv_kernel": hf.get("conv_L_cache", 3),
            "intermediate_size": _ff_dim(hf), "rms_norm_eps": hf.get("norm_eps", 1e-5),
            "tie_word_embeddings": hf.get("tie_word_embeddings", hf.get("tie_embedding", True))}


ARCH = Arch("lfm2", ("lfm2",), from_gguf, from_hf,
            gguf_names={"shortconv.conv.weight": "conv", "shortconv.in_proj.weight": "in_proj",
                        "shortconv.out_proj.weight": "out"},
            gguf_global_names={"token_embd_norm.weight": "norm"},
            hf_names={"conv.conv.weight": "conv", "conv.in_proj.weight": "in_proj", "conv.out_proj.weight": "out",
                      "operator_norm.weight": "input_norm", "ffn_norm.weight": "post_norm",
                      "feed_forward.w1.weight": "gate", "feed_forward.w3.weight": "up", "feed_forward.w2.weight": "down",
                      "self_attn.out_proj.weight": "o", "self_attn.q_layernorm.weight": "q_norm",
                      "self_attn.k_layernorm.weight": "k_norm"},
            hf_global_names={"model.embedding_norm.weight": "norm"})
