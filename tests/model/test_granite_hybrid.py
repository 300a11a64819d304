"""Granite 4.0-H: Mamba-2 layers (a convolution and an SSM state per sequence) beside attention layers without
rotary, a shared SwiGLU MLP in every layer (plus experts on the MoE sizes) and Granite's multipliers. Tiny random
models from transformers' own config, as HF directories and as GGUF files written the way llama.cpp's converter
writes them (KV heads per layer, 0 on the Mamba layers; A as -exp(A_log); the norm per group; q/k rows permuted);
against transformers in float32 on both backends, alone, batched with 16-token chunks, under preemption, and with a
prefix hit that restores the state saved at a block boundary."""

import gguf
import numpy as np
import pytest
import torch

from helpers import add_default_vocab, gguf_add, gguf_finish, save_hf_and_gguf
from test_qwen3_5 import _check

TYPES = ("mamba", "full", "mamba", "mamba", "full")


def _hf_model(vocab: int, moe: bool = False):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GraniteMoeHybridConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=32, num_hidden_layers=len(TYPES), num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
        eos_token_id=2, bos_token_id=1, pad_token_id=0, layer_types=["mamba" if t == "mamba" else "attention"
                                                                     for t in TYPES],
        mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
        num_local_experts=4 if moe else 0, num_experts_per_tok=2, shared_intermediate_size=96,
        position_embedding_type="nope", embedding_multiplier=2.0, attention_multiplier=0.2,
        residual_multiplier=0.5, logits_scaling=1.5)
    model = tf.GraniteMoeHybridForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():  # larger weights: confident greedy choices; norms not all 1
            if name.endswith(("A_log", "dt_bias", "mamba.D")):
                p.copy_(torch.rand_like(p) * 2)  # decays between exp(-e^2) and exp(-1) per unit of dt
            else:
                p.mul_(8.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.config._attn_implementation = "eager"
    return model.eval()


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for its rotary (the converter applies it even without rotary)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: str, model) -> None:
    c = model.config
    moe = bool(c.num_local_experts)
    w = gguf.GGUFWriter(path, "granitehybrid")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.shared_intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if t == "full" else 0 for t in TYPES])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_ssm_conv_kernel(c.mamba_d_conv)
    w.add_ssm_state_size(c.mamba_d_state)
    w.add_ssm_group_count(c.mamba_n_groups)
    w.add_ssm_inner_size(c.mamba_expand * c.hidden_size)
    w.add_ssm_time_step_rank(c.mamba_n_heads)
    w.add_rope_scaling_finetuned(False)
    w.add_embedding_scale(c.embedding_multiplier)
    w.add_residual_scale(c.residual_multiplier)
    w.add_attention_scale(c.attention_multiplier)
    w.add_logit_scale(c.logits_scaling)
    if moe:
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
    w.add_vocab_size(c.vocab_size)
    add_default_vocab(w, c.bos_token_id, c.eos_token_id)
    groups, inner = c.mamba_n_groups, c.mamba_expand * c.hidden_size
    sd = {k: v.float().numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    tensors = {"token_embd.weight": sd.pop("model.embed_tokens.weight"), "output_norm.weight": sd.pop("model.norm.weight")}
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        tensors[b + "attn_norm.weight"] = sd.pop(p + "input_layernorm.weight")
        tensors[b + "ffn_norm.weight"] = sd.pop(p + "post_attention_layernorm.weight")
        gate, up = np.split(sd.pop(p + "shared_mlp.input_linear.weight"), 2)
        shexp = "_shexp" if moe else ""
        tensors |= {f"{b}ffn_gate{shexp}.weight": gate, f"{b}ffn_up{shexp}.weight": up,
                    f"{b}ffn_down{shexp}.weight": sd.pop(p + "shared_mlp.output_linear.weight")}
        if moe:
            gate_up = sd.pop(p + "block_sparse_moe.experts.gate_up_proj")
            tensors |= {b + "ffn_gate_inp.weight": sd.pop(p + "block_sparse_moe.router.weight"),
                        b + "ffn_gate_exps.weight": gate_up[:, :c.intermediate_size],
                        b + "ffn_up_exps.weight": gate_up[:, c.intermediate_size:],
                        b + "ffn_down_exps.weight": sd.pop(p + "block_sparse_moe.experts.down_proj")}
        if TYPES[i] == "mamba":
            m = p + "mamba."
            tensors |= {b + "ssm_in.weight": sd.pop(m + "in_proj.weight"), b + "ssm_out.weight": sd.pop(m + "out_proj.weight"),
                        b + "ssm_conv1d.weight": sd.pop(m + "conv1d.weight").squeeze(1),
                        b + "ssm_conv1d.bias": sd.pop(m + "conv1d.bias"), b + "ssm_dt.bias": sd.pop(m + "dt_bias"),
                        b + "ssm_a": -np.exp(sd.pop(m + "A_log")).reshape(-1, 1),
                        b + "ssm_d": sd.pop(m + "D").reshape(-1, 1),
                        b + "ssm_norm.weight": sd.pop(m + "norm.weight").reshape(groups, inner // groups)}
        else:
            a = p + "self_attn."
            tensors |= {b + "attn_q.weight": _permute(sd.pop(a + "q_proj.weight"), c.num_attention_heads),
                        b + "attn_k.weight": _permute(sd.pop(a + "k_proj.weight"), c.num_key_value_heads),
                        b + "attn_v.weight": sd.pop(a + "v_proj.weight"),
                        b + "attn_output.weight": sd.pop(a + "o_proj.weight")}
    assert not sd, sorted(sd)  # every tensor written
    for name, t in tensors.items():
        gguf_add(w, name, t)
    gguf_finish(w)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_hf_directory_and_gguf_match_transformers(tmp_path, llm, moe):
    model = _hf_model(llm.engine.core.vocab_size, moe)
    d, path = save_hf_and_gguf(tmp_path, llm, model, _write_gguf, "tiny-granite")
    for src in (str(d), path):
        _check(src, model, "granitehybrid", TYPES, ("Mamba2", "Attention"))


def test_long_prompt_runs_the_chunked_scan(tmp_path, llm):
    """A 150-token prompt in one step: the scan's chunks of 64 rows carry the state from one to the next (and the
    prompt's last block boundary, at 144, splits a chunk for its snapshot); the same tokens and logprobs as
    transformers, then a prompt extending it restores that snapshot."""
    from pagedllm import LLM, SamplingParams
    from test_architectures import MAX_TOKENS, _reference

    model = _hf_model(llm.engine.core.vocab_size)
    d = tmp_path / "hf"
    model.save_pretrained(d, safe_serialization=True)
    llm.get_tokenizer().save_pretrained(d)
    prompt = [(i * 37) % 5000 + 100 for i in range(150)]
    want, ref_lp = _reference(model, prompt)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    cached = LLM(model=str(d), max_model_len=512, dtype="float32")
    got = cached.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want
    assert max(abs(lp.logprob - ref_lp[i, want[i]].item()) for i, lp in enumerate(got.logprobs)) < 1e-4
    longer = prompt + [7] * 20
    o = cached.generate([longer], sp, use_tqdm=False)[0]
    assert o.num_cached_tokens == 144 and o.outputs[0].token_ids == _reference(model, longer)[0]
