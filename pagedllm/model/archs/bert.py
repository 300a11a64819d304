"""BERT-family encoders (all-MiniLM, bge, e5 ...): absolute position and token-type embeddings added to the word
embeddings and layer-normed, then post-norm layers (attention with q/k/v/o biases, add, LayerNorm; a GELU (erf) MLP
with biases, add, LayerNorm), every token attending to the whole text. An embedding model: ``model.encoder``
runs it, its sentence-transformers modules (``model.sentence``) pool it."""

from pagedllm.model.archs import Arch, GGUFMeta


def from_gguf(meta: GGUFMeta) -> dict:
    return {"encoder": True, "hidden_act": "gelu", "rms_norm_eps": float(meta.kv("attention.layer_norm_epsilon", 1e-12)),
            "type_vocab_size": int(meta.get("tokenizer.ggml.token_type_count", 2)), "tie_word_embeddings": False,
            "attention_bias": True}


def from_hf(hf: dict) -> dict:
    heads = [a for a in hf.get("architectures") or () if not a.endswith(("Model", "ForMaskedLM", "ForPreTraining"))]
    if heads:  # e.g. a cross-encoder (BertForSequenceClassification): its head scores pairs, not one text
        raise ValueError(f"bert: {heads[0]} is not supported (an encoder's embeddings are; a cross-encoder's "
                         "classification head is not)")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"bert: position_embedding_type {hf['position_embedding_type']!r} is not supported")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"bert: hidden_act {hf['hidden_act']!r} is not supported (gelu is)")
    return {"encoder": True, "hidden_act": "gelu", "rms_norm_eps": hf.get("layer_norm_eps", 1e-12),
            "type_vocab_size": hf.get("type_vocab_size", 2), "tie_word_embeddings": False, "attention_bias": True,
            "eos_token_id": None, "stop_token_ids": (), "pooling": "cls"}


# the engine's names: the decoders' where they mean the same (q, k, v, o, up, down), and the encoder's own norms
_LAYER = {"attention.self.query": "q", "attention.self.key": "k", "attention.self.value": "v",
          "attention.output.dense": "o", "attention.output.LayerNorm": "attn_norm",
          "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "mlp_norm"}
_GGUF_LAYER = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "attn_output_norm": "attn_norm",
               "ffn_up": "up", "ffn_down": "down", "layer_output_norm": "mlp_norm"}
_SUFFIX = {"weight": "", "bias": "_bias"}

ARCH = Arch(
    "bert", ("bert",), from_gguf, from_hf,
    hf_names={f"{k}.{w}": v + s for k, v in _LAYER.items() for w, s in _SUFFIX.items()},
    gguf_names={f"{k}.{w}": v + s for k, v in _GGUF_LAYER.items() for w, s in _SUFFIX.items()},
    hf_global_names={"embeddings.word_embeddings.weight": "embed", "embeddings.position_embeddings.weight": "pos_embed",
                     "embeddings.token_type_embeddings.weight": "type_embed",
                     "embeddings.LayerNorm.weight": "embed_norm", "embeddings.LayerNorm.bias": "embed_norm_bias"},
    gguf_global_names={"token_embd.weight": "embed", "position_embd.weight": "pos_embed",
                       "token_types.weight": "type_embed", "token_embd_norm.weight": "embed_norm",
                       "token_embd_norm.bias": "embed_norm_bias"},
    hf_layer_prefix="encoder.layer.",
)
