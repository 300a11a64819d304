"""Every registered architecture against HF transformers on the same random weights (float32): a tiny model of
each, made from a transformers config, saved as an HF directory and (llama.cpp's tensor names and conventions) as
a GGUF file; greedy tokens identical and logprobs within 1e-4, alone, and batched with chunked prefill, prefix-cache
hits and preemption. Sliding-window layers get prompts longer than their window."""

import math

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.norm import rms_norm
from pagedllm.layers.ops import TorchOps
from helpers import ARCH_MODULES, model_of

MAX_TOKENS = 16
PROMPTS = [[5, 17, 300, 42, 9], list(range(100, 140)), [1000, 2000, 3000] * 9]
WINDOW = 12  # sliding layers' window: shorter than the prompts and not a multiple of the 16-token blocks


def _hf_model(kind: str, vocab: int, gguf_conventions: bool = False):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  eos_token_id=2, bos_token_id=1)
    if kind == "gemma3":
        cfg = tf.Gemma3TextConfig(**common | dict(num_hidden_layers=7, head_dim=32, sliding_window=WINDOW,
                                                  tie_word_embeddings=True,
                                                  query_pre_attn_scalar=32 if gguf_conventions else 24))
        model = tf.Gemma3ForCausalLM(cfg)
    elif kind == "gemma2":  # soft-capped attention scores (the large random weights make them reach the cap)
        cfg = tf.Gemma2Config(**common | dict(num_hidden_layers=4, head_dim=32, sliding_window=WINDOW,
                                              tie_word_embeddings=True, attn_logit_softcapping=50.0,
                                              final_logit_softcapping=30.0,
                                              query_pre_attn_scalar=32 if gguf_conventions else 24))
        model = tf.Gemma2ForCausalLM(cfg)
    elif kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common | dict(head_dim=32)))
    elif kind == "llama3":  # Llama 3.x rotary scaling, over all three bands of a 16-wide head
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common | dict(rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))))
    elif kind == "llama3.2":  # Llama 3.2 1B/3B: llama3 scaling and the LM head tied to the embedding
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common | dict(tie_word_embeddings=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))))
    elif kind == "smollm3":  # NoPE on every 4th layer (layer 3 of 5: q and k not rotated)
        model = tf.SmolLM3ForCausalLM(tf.SmolLM3Config(**common | dict(num_hidden_layers=5, pad_token_id=0)))
    elif kind == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common | dict(sliding_window=WINDOW, head_dim=16)))
    elif kind == "ministral3":  # YaRN (blending 4 of 16 frequencies; attention factor 1.065) and Llama 4's query
        # temperature from position 16 on: both take effect inside the test's prompts
        model = tf.Ministral3ForCausalLM(tf.Ministral3Config(**common | dict(head_dim=32, rope_parameters=dict(
            rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=16,
            max_position_embeddings=512, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.5,
            llama_4_scaling_beta=0.1))))
    elif kind == "qwen3moe":  # 4 experts, 2 per token
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common | dict(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)))
    elif kind == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**common | dict(num_local_experts=4, num_experts_per_tok=2,
                                                                       sliding_window=None)))
    elif kind == "phi3":
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**common | dict(pad_token_id=0)))
    elif kind == "gpt_oss":  # sinks, sliding (even) and full (odd) layers, YaRN untruncated from position 16 on,
        # 4 experts of 2 per token with biases and the clamped SwiGLU
        model = tf.GptOssForCausalLM(tf.GptOssConfig(**common | dict(
            num_hidden_layers=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
            sliding_window=WINDOW, rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=4.0,
                                                        beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                        original_max_position_embeddings=16))))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for p in model.parameters():  # larger weights: confident greedy choices; norms not all 1
            p.mul_(8.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
        for name, p in model.named_parameters():
            if name.endswith("sinks"):  # sinks that take a visible share of each softmax
                p.copy_(torch.randn_like(p) * 2.0 + 2.0)
    model.config._attn_implementation = "eager"
    return model.eval()


def _reference(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    with torch.inference_mode():
        full = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              min_new_tokens=MAX_TOKENS, pad_token_id=0, eos_token_id=None)
        logits = model(full).logits[0].float()
    return full[0, len(prompt):].tolist(), torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1)


def assert_both_backends_match(llm, model, tag=None) -> None:
    """``llm`` (float32, alone) on the fused CPU kernels and on torch's operations (CUDA's path): PROMPTS' greedy
    tokens equal to transformers' on ``model`` and their logprobs within 1e-4."""
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    built = model_of(llm)
    fused = built.ops
    assert fused.fused
    refs = [_reference(model, p) for p in PROMPTS]
    for ops in (fused, TorchOps()):
        built.ops = ops
        for p, (want, ref_lp) in zip(PROMPTS, refs):
            got = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
            assert got.token_ids == want, (tag, p, type(ops).__name__)
            for i, lp in enumerate(got.logprobs):
                assert abs(lp.logprob - ref_lp[i, want[i]].item()) < 1e-4, (tag, p, i, type(ops).__name__)
    built.ops = fused


def test_each_architecture_is_one_archs_module():
    import importlib

    from pagedllm.model import archs

    assert {importlib.import_module(f"pagedllm.model.archs.{m}").ARCH.name: m for m in archs._MODULES} == {
        a: m for a, (m, _) in ARCH_MODULES.items()}


def _layer_classes(model) -> set[str]:
    return {type(m).__name__ for la in model.layers for m in (la, la.attn, la.mlp)}


def _check(path: str, model, arch: str):
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    alone = LLM(model=path, max_model_len=512, dtype="float32", enable_prefix_caching=False)
    assert alone.engine.core.runner.arch.arch == arch
    built = model_of(alone)
    assert type(built).__name__ == ARCH_MODULES[arch][1]
    mlp = "MoE" if built.cfg.num_experts else "GatedMLP"
    assert _layer_classes(built) == {"DecoderLayer", "Attention", mlp}
    assert_both_backends_match(alone, model, arch)
    del alone
    # batched, prompts in chunks of 16 tokens, a shared prefix (cache hits) and a KV cache too small for all of
    # them at once (preemption): the same tokens
    c = model.config
    block_bytes = 16 * 2 * c.num_key_value_heads * (getattr(c, "head_dim", None) or 16) * 4 * c.num_hidden_layers
    busy = LLM(model=path, max_model_len=128, dtype="float32", max_num_batched_tokens=16,
               kv_cache_memory=8 * block_bytes)  # 8 blocks of 16 tokens; the prompts and outputs need 16
    prompts = PROMPTS + [PROMPTS[1] + [7, 8, 9], PROMPTS[2][:20]]
    outs = busy.generate(prompts, sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _reference(model, p)[0], (arch, p)
    sched = busy.engine.core.scheduler
    assert sched.counters.num_preemptions > 0 and sched.kv.prefix_cache_hits > 0


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "qwen3", "llama3", "llama3.2", "smollm3", "mistral", "phi3",
                                  "qwen3moe", "mixtral", "ministral3", "gpt_oss"])
def test_hf_directory_matches_transformers(tmp_path, llm, kind):
    model = _hf_model(kind, llm.engine.core.vocab_size)
    d = tmp_path / kind
    model.save_pretrained(d, safe_serialization=True)
    llm.get_tokenizer().save_pretrained(d)
    _check(str(d), model, {"mistral": "llama", "llama3": "llama", "llama3.2": "llama", "mixtral": "llama",
                           "ministral3": "mistral3", "gpt_oss": "gpt-oss"}.get(kind, kind))


def test_gemma_norms_multiply_in_float32_under_bfloat16(tmp_path, llm):
    """Under bfloat16, Gemma's RMSNorm weights stay float32 (1 + w, as HF adds it in float32) and each norm rounds
    once, as HF's bfloat16 model computes it: rounding 1 + w to bfloat16 moved every weight by up to 0.4%. The
    checkpoint is HF's bfloat16 model; our final norm equals HF's on the same hidden states (the torch path bit
    for bit, the fused kernel's other reduction order within an ulp), and the model generates."""

    model = _hf_model("gemma3", llm.engine.core.vocab_size).to(torch.bfloat16)
    d = tmp_path / "gemma3_bf16"
    model.save_pretrained(d, safe_serialization=True)
    llm.get_tokenizer().save_pretrained(d)
    ours = LLM(model=str(d), max_model_len=128, dtype="bfloat16", enable_prefix_caching=False)
    m = ours.engine.runner.model
    assert all(t.dtype == torch.float32 for t in [m.norm] + [t for la in m.layers for t in la.norms().values()])
    h = (torch.randn(9, 64) * 4).bfloat16()
    with torch.inference_mode():
        ref = model.model.norm(h)
    assert torch.equal(rms_norm(h, m.norm, 1e-6), ref)
    assert (m.ops.rms_norm(h, m.norm, 1e-6) == ref).float().mean() > 0.97
    out = ours.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_sliding_layers_hold_only_their_window(tmp_path, llm):
    """Gemma 3's sliding layers (window 12) keep only the blocks inside their window as a long request grows
    (per-layer-group block tables): the KV bytes /debug/kv reports for the request are the full layer's whole
    context plus two blocks per sliding layer, not seven layers' whole context; greedy tokens still equal HF's,
    with 32-token prefill chunks crossing the window."""
    model = _hf_model("gemma3", llm.engine.core.vocab_size)
    d = tmp_path / "gemma3"
    model.save_pretrained(d, safe_serialization=True)
    llm.get_tokenizer().save_pretrained(d)
    ours = LLM(model=str(d), max_model_len=256, dtype="float32", max_num_batched_tokens=32,
               enable_prefix_caching=False)
    eng = ours.engine
    assert eng.kv_state()["kv_layer_groups"] == 7  # 1 full + 6 sliding layers: groups of one layer
    prompt = [(i * 37) % 900 + 50 for i in range(150)]
    eng.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    bpb, req, tokens = eng.runner.bytes_per_block, eng.core.scheduler.requests["long"], []
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens = o.outputs[0].token_ids
        if req.num_computed_tokens >= 64 and "long" in eng.kv_state()["kv_bytes_per_request"]:
            held = eng.kv_state()["kv_bytes_per_request"]["long"] // bpb
            full = math.ceil((req.num_computed_tokens + 1) / 16)
            # a sliding layer: the blocks of its window (12 keys) and of a 32-token chunk, at most 4
            assert held <= full + 6 * 4, (req.num_computed_tokens, held)
            if req.num_computed_tokens > len(prompt):  # decoding: the window's 2 blocks (7 x 11 without freeing)
                assert held <= full + 6 * 2, (req.num_computed_tokens, held)
    assert tokens == _reference(model, prompt)[0]
    assert eng.kv_state()["consistent"] and eng.kv_state()["num_free_blocks"] == eng.kv_state()["num_blocks"]


# llama.cpp's tensor names for the HF ones (per layer)
GGUF_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # phi3: fused in the checkpoint and the file
}
GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture (HF half split -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gpt_oss_tensors(w, c, state: dict, mxfp4: bool) -> None:
    """gpt-oss's keys and layers as llama.cpp's converter writes them (its tensors popped from ``state``): YaRN's
    keys, the experts' gate and up de-interleaved and stacked with their biases, in MXFP4 blocks with ``mxfp4``;
    the sinks, the router's bias, the norm before the MLP named ``post_attention_norm``."""
    w.add_sliding_window(c.sliding_window)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.intermediate_size)
    rope = c.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_sinks.weight", state.pop(p + "self_attn.sinks"))
        w.add_tensor(f"blk.{i}.post_attention_norm.weight", state.pop(p + "post_attention_layernorm.weight"))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", state.pop(p + "mlp.router.weight"))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.bias", state.pop(p + "mlp.router.bias"))
        gate_up = state.pop(p + "mlp.experts.gate_up_proj").transpose(0, 2, 1)  # (E, 2I, H), interleaved rows
        bias = state.pop(p + "mlp.experts.gate_up_proj_bias")
        down = state.pop(p + "mlp.experts.down_proj").transpose(0, 2, 1)  # (E, H, I)
        for name, t, b in (("gate", gate_up[:, 0::2], bias[:, 0::2]), ("up", gate_up[:, 1::2], bias[:, 1::2]),
                           ("down", down, state.pop(p + "mlp.experts.down_proj_bias"))):
            t = np.ascontiguousarray(t, dtype=np.float32)
            if mxfp4:
                w.add_tensor(f"blk.{i}.ffn_{name}_exps.weight", gguf.quants.quantize(t, gguf.GGMLQuantizationType.MXFP4),
                             raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            else:
                w.add_tensor(f"blk.{i}.ffn_{name}_exps.weight", t)
            w.add_tensor(f"blk.{i}.ffn_{name}_exps.bias", np.ascontiguousarray(b, dtype=np.float32))


def _mxfp4_experts(model) -> None:
    """gpt-oss's expert weights rounded to MXFP4's values in place (gguf's quantizer), so that a file with them in
    MXFP4 blocks holds the reference's exact numbers."""
    q = gguf.GGMLQuantizationType.MXFP4
    with torch.no_grad():
        for layer in model.model.layers:
            for t in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                rows = t.transpose(1, 2).contiguous().numpy()  # blocks of 32 along each output row's inputs
                t.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(rows, q), q)).transpose(1, 2))


def _write_gguf(path: str, kind: str, model, eot: int | None = None, q8_experts: bool = False,
                extra: dict | None = None, mxfp4_experts: bool = False) -> None:
    from pagedllm.config import default_model_path
    from pagedllm.gguf_file import GGUFFile

    src = GGUFFile(default_model_path())
    c = model.config
    arch = {"llama3": "llama", "llama3.2": "llama", "gpt_oss": "gpt-oss", "ministral3": "mistral3"}.get(kind, kind)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if kind in ("gemma2", "gemma3"):
        w.add_sliding_window(c.sliding_window)
    if kind == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if kind == "ministral3":  # as llama.cpp's converter writes it (conversion/mistral3.py on base.py's YaRN keys)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    for key, fn in (("model", w.add_tokenizer_model), ("pre", w.add_tokenizer_pre), ("tokens", w.add_token_list),
                    ("token_type", w.add_token_types), ("merges", w.add_token_merges)):
        fn(src.get(f"tokenizer.ggml.{key}"))
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    if eot is not None:
        w.add_eot_token_id(eot)
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    plus_one = kind in ("gemma2", "gemma3")  # llama.cpp stores gemma's norm weights as 1 + w
    names = GGUF_LAYER | (GEMMA_LAYER if plus_one else {"post_attention_layernorm": "ffn_norm"})
    if kind == "gpt_oss":
        _gpt_oss_tensors(w, c, state, mxfp4_experts)
    if kind == "qwen3moe":  # experts stacked per layer, as llama.cpp writes them
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}.mlp."
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", state.pop(p + "gate.weight"))  # the router stays F32
            gate, up = np.split(state.pop(p + "experts.gate_up_proj"), 2, axis=1)  # (E, 2I, H) in memory
            for out, t in (("ffn_gate_exps", gate), ("ffn_up_exps", up),
                           ("ffn_down_exps", state.pop(p + "experts.down_proj"))):
                t = np.ascontiguousarray(t)
                if q8_experts:  # in Q8_0 blocks, as quantized files hold them
                    w.add_tensor(f"blk.{i}.{out}.weight", gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                else:
                    w.add_tensor(f"blk.{i}.{out}.weight", t)
    for name, t in state.items():
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            i, rest = name[len("model.layers."):].split(".", 1)
            mod, suffix = rest.rsplit(".", 1)
            out = f"blk.{i}.{names[mod]}.{suffix}"
            if arch in ("llama", "smollm3", "mistral3") and mod in ("self_attn.q_proj", "self_attn.k_proj"):
                t = _permute(t, c.num_attention_heads if "q_proj" in mod else c.num_key_value_heads)
        if plus_one and name.endswith("norm.weight"):
            t = 1.0 + t
        t = np.ascontiguousarray(t, dtype=np.float32)
        if q8_experts and t.ndim == 2:  # every linear and the embedding in Q8_0 blocks
            w.add_tensor(out, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(out, t)
    if kind.startswith("llama3"):  # llama.cpp's per-frequency divisors for Llama 3 scaling
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        base = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](c, "cpu")
        w.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "qwen3", "llama3", "llama3.2", "smollm3", "qwen3moe", "phi3",
                                  "ministral3", "gpt_oss"])
def test_gguf_file_matches_transformers(tmp_path, llm, kind):
    model = _hf_model(kind, llm.engine.core.vocab_size, gguf_conventions=True)
    path = str(tmp_path / f"tiny-{kind}.gguf")
    if kind == "gpt_oss":  # its experts in MXFP4 blocks, as its GGUF files hold them (the reference on their values)
        _mxfp4_experts(model)
    _write_gguf(path, kind, model, mxfp4_experts=kind == "gpt_oss")
    _check(path, model, {"gpt_oss": "gpt-oss", "ministral3": "mistral3"}.get(
        kind, "llama" if kind.startswith("llama3") else kind))


def test_gemma3_config_from_gguf_metadata(tmp_path, llm):
    """The 5:1 local/global pattern, the window, the local rotary base, the scaled embedding and <end_of_turn>."""
    from pagedllm.model.loader import load_gguf

    model = _hf_model("gemma3", llm.engine.core.vocab_size, gguf_conventions=True)
    path = str(tmp_path / "g.gguf")
    _write_gguf(path, "gemma3", model)
    cfg, _ = load_gguf(path)
    assert cfg.layer_types == ("sliding",) * 5 + ("full", "sliding")
    assert cfg.window(0) == WINDOW and cfg.window(5) == 0
    assert cfg.rope_local_theta == 10000.0 and cfg.rope_theta == 1e6
    assert cfg.embed_scale == math.sqrt(64) and cfg.qk_norm and cfg.sandwich_norm and cfg.hidden_act == "gelu_tanh"


def test_end_of_turn_token_stops_generation(tmp_path, llm):
    """A file's end-of-turn token (``tokenizer.ggml.eot_token_id``; gemma: <end_of_turn>) ends a request as eos
    does, unless eos is ignored."""
    model = _hf_model("gemma3", llm.engine.core.vocab_size, gguf_conventions=True)
    want, _ = _reference(model, PROMPTS[1])
    eot = want[3]  # the fourth token the model picks
    path = str(tmp_path / "eot.gguf")
    _write_gguf(path, "gemma3", model, eot=eot, extra={"gemma3.pooling_type": 1})  # llama.cpp's 1: mean
    ours = LLM(model=path, max_model_len=128, dtype="float32")
    assert ours.engine.core.runner.arch.stop_token_ids == (eot,)
    # the file's pooling type is the embeddings' default
    assert ours.engine.default_pooling == "mean"
    emb = ours.embed([PROMPTS[1]], normalize=False, use_tqdm=False)[0]
    with torch.inference_mode():
        hidden = model(torch.tensor([emb.prompt_token_ids]), output_hidden_states=True).hidden_states[-1][0]
    assert torch.allclose(torch.tensor(emb.embedding), hidden.float().mean(dim=0), atol=1e-4)
    out = ours.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert out[0].outputs[0].token_ids == want[:want.index(eot) + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    out = ours.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert out[0].outputs[0].token_ids == want


@pytest.mark.parametrize("kind", ["qwen3moe", "phi3", "gpt_oss"])
def test_quantized_file_runs_from_its_blocks(tmp_path, llm, kind):
    """Every linear in Q8_0 blocks (qwen3moe: experts stacked per layer; phi3: q/k/v and gate/up fused in the
    file; gpt-oss: its experts in MXFP4 blocks, the rest Q8_0): the block path (``--quantization gguf``: the
    default's measured plan may keep float copies for a model this small) runs them in the block kernel (each expert
    sliced out of its layer's tensor), and its greedy tokens and logprobs follow the float32 path's on the same
    file."""
    model = _hf_model(kind, llm.engine.core.vocab_size, gguf_conventions=True)
    path = str(tmp_path / f"{kind}-q8.gguf")
    _write_gguf(path, kind, model, q8_experts=True, mxfp4_experts=kind == "gpt_oss")
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    ref = LLM(model=path, max_model_len=128, dtype="float32").generate(PROMPTS, sp, use_tqdm=False)
    # the int8 block kernels at every step size (on AMX CPUs auto would run larger steps on bfloat16 tiles)
    auto = LLM(model=path, max_model_len=128, quantization="gguf", large_step_weights="blocks")
    lins = model_of(auto).linears()
    mlp = [f"layers.1.experts.{e}.{n}" for e in range(4) for n in ("gate_up", "down")] if kind != "phi3" else [
        "layers.1.gate_up", "layers.1.down"]
    assert lins["layers.1.qkv"].kind == "q8-block"
    # MXFP4: 4-bit codes through its table of values (half a byte per weight, as in the file)
    assert {(lins[n].kind, lins[n].table is not None) for n in mlp} == (
        {("q4-block", True)} if kind == "gpt_oss" else {("q8-block", False)})
    for g, r in zip(auto.generate(PROMPTS, sp, use_tqdm=False), ref):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, r.outputs[0].logprobs):
            assert abs(a.logprob - b.logprob) < 0.02


def test_unsupported_variants_are_refused_by_name(tmp_path, llm):
    """What the layers do not implement stops the load with its name: partial rotary in a GGUF file, Qwen's
    optional sliding window, mixture-of-experts under tensor parallelism, a Ministral 3 GGUF file whose attention
    temperature has no length."""
    import json

    from pagedllm.model.arch import tp_layout
    from pagedllm.model.loader import load_gguf, load_hf_dir
    from pagedllm.sim.model_profile import load_model_profile

    model = _hf_model("qwen3", llm.engine.core.vocab_size)
    path = str(tmp_path / "partial.gguf")
    _write_gguf(path, "qwen3", model, extra={"qwen3.rope.dimension_count": 16})
    with pytest.raises(ValueError, match="partial rotary"):
        load_gguf(path)
    from pagedllm.model.archs import GGUFMeta, ministral3

    keys = {"mistral3.attention.temperature_scale": 0.1}  # the temperature's length is YaRN's original context
    with pytest.raises(ValueError, match="temperature_scale without"):
        ministral3.from_gguf(GGUFMeta("mistral3", lambda k, d=None: keys.get(k, d), set(), None))
    d = tmp_path / "qwen3-swa"
    model.save_pretrained(d, safe_serialization=True)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"use_sliding_window": True}))
    with pytest.raises(ValueError, match="use_sliding_window"):
        load_hf_dir(str(d))
    moe = _hf_model("qwen3moe", llm.engine.core.vocab_size)
    d = tmp_path / "moe"
    moe.save_pretrained(d, safe_serialization=True)
    arch, _ = load_hf_dir(str(d))
    assert tp_layout(arch, 1).intermediate_size == arch.intermediate_size
    with pytest.raises(ValueError, match="mixture-of-experts"):
        tp_layout(arch, 2)
    profile = load_model_profile(str(d))  # the simulator: its active experts (tests/sim)
    assert profile.arch == arch and {g.copies for g in profile.linear_groups()} == {1, arch.num_experts}


def test_generation_config_eos_ids_stop_too(tmp_path, llm):
    """An HF directory's generation_config.json eos list (gemma: <eos> and <end_of_turn>) adds stop tokens."""
    import json

    from pagedllm.model.loader import load_hf_dir

    model = _hf_model("gemma3", llm.engine.core.vocab_size)
    d = tmp_path / "g"
    model.save_pretrained(d, safe_serialization=True)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 106]}))
    cfg, _ = load_hf_dir(str(d))
    assert cfg.eos_token_id == 2 and cfg.stop_token_ids == (106,)


def test_gpt_oss_serves_through_the_openai_api(tmp_path_factory, llm):
    """gpt-oss as llama.cpp writes it (MXFP4 experts) behind the server with its defaults: /v1/completions' greedy
    text, whole and streamed, is the text of transformers' tokens on the file's numbers."""
    model = _hf_model("gpt_oss", llm.engine.core.vocab_size, gguf_conventions=True)
    _mxfp4_experts(model)
    path = str(tmp_path_factory.mktemp("gpt-oss") / "tiny-gpt-oss.gguf")
    _write_gguf(path, "gpt_oss", model, mxfp4_experts=True)
    assert_served_greedy_text(tmp_path_factory, path, llm.get_tokenizer().decode(_reference(model, PROMPTS[1])[0]))


def assert_served_greedy_text(tmp_path_factory, path: str, want: str) -> None:
    """``path`` behind ``pagedllm serve`` with its defaults: /v1/completions' greedy text of PROMPTS[1], whole and
    streamed, is ``want``."""
    import openai

    from helpers import start_server

    proc, base, _ = start_server(tmp_path_factory, "--model", path, "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
        assert client.completions.create(**kw).choices[0].text == want
        assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == want
    finally:
        proc.terminate()
        proc.wait(30)


def _ocp_mxfp4(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) of (..., K) float rows in transformers' MXFP4 layout (a byte's low nibble the even element),
    from gguf's quantizer (which packs elements 0-15 low, 16-31 high)."""
    q = gguf.quants.quantize(np.ascontiguousarray(rows, dtype=np.float32), gguf.GGMLQuantizationType.MXFP4)
    q = q.reshape(*rows.shape[:-1], -1, 17)
    nib = np.concatenate([q[..., 1:] & 0x0F, q[..., 1:] >> 4], axis=-1)  # (..., K/32, 32) codes in element order
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8), q[..., 0].copy()


def test_gpt_oss_hf_directory_in_mxfp4(tmp_path, llm):
    """gpt-oss's HF directory as released: experts as MXFP4 blocks and scales (``quantization_config`` mxfp4).
    ``--dtype float32`` decodes them (transformers' tokens on the same numbers); the default runs them in the block
    kernel, 4-bit codes through their table, its greedy tokens following the float path's."""
    import json

    from safetensors.torch import load_file, save_file

    model = _hf_model("gpt_oss", llm.engine.core.vocab_size)
    _mxfp4_experts(model)
    d = tmp_path / "gpt-oss-mxfp4"
    model.save_pretrained(d, safe_serialization=True)
    llm.get_tokenizer().save_pretrained(d)
    state = load_file(str(d / "model.safetensors"))
    for i in range(model.config.num_hidden_layers):
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks, scales = _ocp_mxfp4(state.pop(key).transpose(1, 2).numpy())  # output rows first
            state[key + "_blocks"], state[key + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
    (d / "model.safetensors").unlink()
    save_file(state, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"quantization_config": {"quant_method": "mxfp4"}}))
    _check(str(d), model, "gpt-oss")
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    auto = LLM(model=str(d), max_model_len=128)
    lins = model_of(auto).linears()
    assert {(lins[f"layers.1.experts.{e}.{n}"].kind, lins[f"layers.1.experts.{e}.{n}"].table_zero)
            for e in range(4) for n in ("gate_up", "down")} == {("q4-block", 16)}
    for p, g in zip(PROMPTS, auto.generate(PROMPTS, sp, use_tqdm=False)):
        want, ref_lp = _reference(model, p)
        assert g.outputs[0].token_ids == want
        for i, lp in enumerate(g.outputs[0].logprobs):
            assert abs(lp.logprob - ref_lp[i, want[i]].item()) < 0.02


def test_gpt_oss_gguf_stops_at_return_and_call():
    """A gpt-oss file's turn ends at <|return|> and a tool call at <|call|> (found by their text, as llama.cpp finds
    them), not at <|end|>, whatever its eos says; its window, experts and untruncated YaRN come from its keys."""
    from pagedllm.model.archs import GGUFMeta, gpt_oss

    tokens = ["a", "<|end|>", "<|return|>", "<|call|>", "<|endoftext|>"]
    kv = {"gpt-oss.block_count": 4, "gpt-oss.attention.sliding_window": 128, "gpt-oss.expert_count": 32,
          "gpt-oss.expert_used_count": 4, "gpt-oss.expert_feed_forward_length": 2880,
          "gpt-oss.rope.scaling.type": "yarn", "gpt-oss.rope.scaling.factor": 32.0,
          "gpt-oss.rope.scaling.original_context_length": 4096, "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.eos_token_id": 4}
    out = gpt_oss.from_gguf(GGUFMeta("gpt-oss", lambda k, d=None: kv.get(k, d), set(), None))
    assert out["stop_token_ids"] == (2, 3)
    assert out["layer_types"] == ("sliding", "full") * 2 and out["sliding_window"] == 128
    assert (out["num_experts"], out["num_experts_per_tok"], out["moe_intermediate_size"]) == (32, 4, 2880)
    assert out["rope_scaling"]["truncate"] is False and out["rope_scaling"]["factor"] == 32.0
