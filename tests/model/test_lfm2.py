"""LFM2: gated short-convolution layers (a per-sequence state of their last inputs) beside attention layers with
QK-norm. A tiny random model from transformers' own config, as an HF directory and as a GGUF file written the way
llama.cpp's converter writes it (KV heads per layer, 0 on the convolution layers; the convolution squeezed;
``token_embd_norm`` as the final norm); against transformers in float32 on both backends, alone, batched with
16-token chunks, under preemption, and with a prefix hit that restores the convolution's saved inputs."""

import gguf
import numpy as np
import torch

from helpers import add_default_vocab, gguf_finish, gguf_stacked_experts, save_hf_and_gguf
from test_qwen3_5 import _check

TYPES = ("conv", "conv", "full", "conv", "full")


def _hf_model(vocab: int, moe: bool = False):
    import transformers as tf

    torch.manual_seed(0)
    if moe:  # LFM2-MoE: layer 0's MLP dense, the others 4 experts of 32, 2 per token, sigmoid-routed with a bias
        cfg = tf.Lfm2MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                               num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=512, norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=2,
                               bos_token_id=1, pad_token_id=0, conv_L_cache=3, num_experts=4, num_experts_per_tok=2,
                               num_dense_layers=1, routed_scaling_factor=1.5,
                               layer_types=["full_attention" if t == "full" else "conv" for t in TYPES])
        model = tf.Lfm2MoeForCausalLM(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.mul_(8.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
            for layer in model.model.layers[1:]:  # a bias that changes which experts win
                layer.feed_forward.expert_bias.copy_(torch.randn(4) * 0.3)
        model.config._attn_implementation = "eager"
        return model.eval()
    cfg = tf.Lfm2Config(vocab_size=vocab, hidden_size=64, intermediate_size=192, num_hidden_layers=5,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, norm_eps=1e-5,
                        tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=0, conv_L_cache=3,
                        block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
                        layer_types=["full_attention" if t == "full" else "conv" for t in TYPES])
    model = tf.Lfm2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # larger weights: confident greedy choices; norms not all 1
            p.mul_(8.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.config._attn_implementation = "eager"
    return model.eval()


def _write_gguf(path: str, model) -> None:
    c = model.config
    moe = c.model_type == "lfm2_moe"
    w = gguf.GGUFWriter(path, "lfm2moe" if moe else "lfm2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(model.model.layers[0].feed_forward.w1.out_features)
    if moe:  # as llama.cpp's converter: the experts' sizes, sigmoid gating, the leading dense layers
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_leading_dense_block_count(c.num_dense_layers)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if t == "full" else 0 for t in TYPES])
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_shortconv_l_cache(c.conv_L_cache)
    w.add_vocab_size(c.vocab_size)
    add_default_vocab(w, c.bos_token_id, c.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2MOE if moe else gguf.MODEL_ARCH.LFM2, c.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        t = t.float().numpy()
        if gguf_stacked_experts(w, name, t):
            continue
        if name.endswith("expert_bias"):
            w.add_tensor(f"blk.{name.split('.')[2]}.exp_probs_b.bias", np.ascontiguousarray(t))
            continue
        if "conv.conv" in name:
            t = t.reshape(t.shape[0], -1)
        base, _, suffix = name.rpartition(".")
        w.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(t, dtype=np.float32))
    gguf_finish(w)


def test_hf_directory_and_gguf_match_transformers(tmp_path, llm):
    model = _hf_model(llm.engine.core.vocab_size)
    d, path = save_hf_and_gguf(tmp_path, llm, model, _write_gguf, "tiny-lfm2")
    for src in (str(d), path):
        _check(src, model, "lfm2", TYPES, ("ShortConv", "Attention"))


def test_moe_matches_transformers(tmp_path, llm):
    """LFM2-MoE: the same layers, the first MLP dense and the others sigmoid-routed experts (the top 2 of 4 by score
    plus a bias, renormalised, times 1.5); as an HF directory (experts one tensor each, as the checkpoints store
    them) and as llama.cpp's GGUF (stacked experts, ``exp_probs_b``)."""
    model = _hf_model(llm.engine.core.vocab_size, moe=True)
    d, path = save_hf_and_gguf(tmp_path, llm, model, _write_gguf, "tiny-lfm2moe")
    for src in (str(d), path):
        _check(src, model, "lfm2moe", TYPES, ("ShortConv", "Attention"))
