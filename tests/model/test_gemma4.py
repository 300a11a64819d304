"""Gemma 4 (text): tiny random models from transformers' own config, as HF directories and as GGUF files written
the way llama.cpp's converter writes them (per-layer KV heads and feed-forward sizes, the sliding pattern, the full
layers' ``rope_freqs`` factors for their proportional rotary); against transformers in float32 on both backends,
alone, batched in 16-token chunks with prefix hits and preemption. Three shapes: the E2B kind (per-layer inputs,
the last layers reading earlier layers' K/V, double-wide MLPs there, full layers with twice the head size, a layer
scalar), the 31B kind (full layers whose values are their keys' projection, with their own KV heads) and the
26B-A4B kind (the 31B's attention, experts beside the dense MLP)."""

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from helpers import add_default_vocab, gguf_add, gguf_finish, model_of, save_hf_and_gguf
from test_architectures import (MAX_TOKENS, PROMPTS, WINDOW, _reference, assert_both_backends_match,
                                assert_served_greedy_text)

TYPES = ("sliding", "sliding", "full", "sliding", "sliding", "full")


def _hf_model(vocab: int, kind: str = "e2b", scale: float = 5.0, ple: int = 8):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=len(TYPES),
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                  sliding_window=WINDOW, max_position_embeddings=512, eos_token_id=2, bos_token_id=1,
                  layer_types=[f"{t}_attention" for t in TYPES])
    if kind == "e2b":
        cfg = tf.Gemma4TextConfig(**common, num_kv_shared_layers=2, hidden_size_per_layer_input=ple,
                                  vocab_size_per_layer_input=vocab, use_double_wide_mlp=True,
                                  final_logit_softcapping=30.0)
    else:  # 31B: values = keys on the full layers, which have 1 KV head of their own; "moe": 26B-A4B's experts
        # (top 2 of 4) beside the dense MLP too
        moe = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
        cfg = tf.Gemma4TextConfig(**common, attention_k_eq_v=True, num_global_key_value_heads=1,
                                  hidden_size_per_layer_input=0, **(moe if kind == "moe" else {}))
    model = tf.Gemma4ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # larger weights: confident greedy choices (x8: within the 8-bit blocks'
            # error; x5 keeps float32's rounding differences through the 6 layers under 1e-4); norms not all 1
            p.mul_(scale) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.5 + 0.1 * i)
    model.config._attn_implementation = "eager"
    return model.eval()


def _write_gguf(path: str, model, q8: bool = False) -> None:
    c = model.config
    n = c.num_hidden_layers
    swa = [t == "sliding_attention" for t in c.layer_types]
    full_dim, full_kv = (getattr(c.per_layer_config[TYPES.index("full")], k) for k in ("head_dim", "num_key_value_heads"))
    swa_dim, swa_kv = (getattr(c.per_layer_config[0], k) for k in ("head_dim", "num_key_value_heads"))
    w = gguf.GGUFWriter(path, "gemma4")
    w.add_block_count(n)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    first_shared = n - c.num_kv_shared_layers
    w.add_feed_forward_length([c.intermediate_size * (2 if c.use_double_wide_mlp and i >= first_shared else 1)
                               for i in range(n)])
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([swa_kv if s else full_kv for s in swa])
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(swa_dim)
    w.add_value_length_swa(swa_dim)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_rope_dimension_count(full_dim)
    w.add_rope_dimension_count_swa(swa_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    w.add_sliding_window_pattern(swa)
    w.add_shared_kv_layers(c.num_kv_shared_layers)
    w.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input or 0)
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if c.enable_moe_block:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.top_k_experts)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_vocab_size(c.vocab_size)
    add_default_vocab(w, c.bos_token_id, c.eos_token_id)
    turned = int(full_dim * c.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * turned + [1e30] * (full_dim // 2 - turned), np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        base, _, suffix = name.rpartition(".")
        if name.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")):
            base, suffix = name, "weight"
        out = f"{names.get_name(base)}.{suffix}"
        if name.endswith(("router.scale", "router.per_expert_scale")):  # the converter's names for them
            out = base.replace("model.layers.", "blk.").replace("router", "ffn_gate_inp" if suffix == "scale"
                                                                else "ffn_down_exps") + ".scale"
        t = t.float().numpy()
        gguf_add(w, out, t, q8 and t.ndim == 2 and t.shape[1] % 32 == 0)
    gguf_finish(w)


@pytest.fixture(scope="module", params=["e2b", "k_eq_v", "moe"])
def tiny(request, tmp_path_factory, llm):
    """(kind, the HF model, its directory, the GGUF file)."""
    model = _hf_model(llm.engine.core.vocab_size, request.param)
    d, path = save_hf_and_gguf(tmp_path_factory.mktemp(f"gemma4_{request.param}"), llm, model, _write_gguf, "tiny-gemma4")
    return request.param, model, str(d), path


def _check(path: str, model, kind: str) -> None:
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    alone = LLM(model=path, max_model_len=512, dtype="float32", enable_prefix_caching=False)
    built = model_of(alone)
    cfg = built.cfg
    assert cfg.arch == "gemma4" and cfg.layer_types == TYPES and (cfg.head_dim, cfg.global_head_dim) == (16, 32)
    shared = [i for i, la in enumerate(built.layers) if la.attn.kv_shared]
    assert shared == ([4, 5] if kind == "e2b" else [])
    if kind == "e2b":  # the sharing layers keep no K/V: they read their source's tensors
        kv = alone.engine.core.runner.kv.kv_caches
        assert kv[4][0].data_ptr() == kv[3][0].data_ptr() and kv[5][0].data_ptr() == kv[2][0].data_ptr()
        assert built.per_layer_inputs is not None and built.layers[4].mlp.down.in_features == 256
    else:
        assert built.layers[2].attn.num_kv_heads == 1 and built.layers[0].attn.num_kv_heads == 2
    assert {type(la.mlp).__name__ for la in built.layers} == {"DenseAndExperts" if kind == "moe" else "GatedMLP"}
    assert_both_backends_match(alone, model)
    bytes_per_block = alone.engine.core.runner.kv.bytes_per_block
    del alone
    # batched, 16-token chunks, a shared prefix and a KV cache too small for all at once (preemption)
    busy = LLM(model=path, max_model_len=128, dtype="float32", max_num_batched_tokens=16,
               kv_cache_memory=20 * bytes_per_block)
    prompts = PROMPTS + [PROMPTS[1] + [7, 8, 9], PROMPTS[2][:20]]
    outs = busy.generate(prompts, sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _reference(model, p)[0], p
    sched = busy.engine.core.scheduler
    assert sched.counters.num_preemptions > 0
    del busy
    # a prompt that extends an earlier one reads that one's cached blocks (the sliding groups' window included)
    cached = LLM(model=path, max_model_len=128, dtype="float32", max_num_batched_tokens=16)
    cached.generate([PROMPTS[1]], sp, use_tqdm=False)
    p = PROMPTS[1] + [5] * 30
    o = cached.generate([p], sp, use_tqdm=False)[0]
    assert o.outputs[0].token_ids == _reference(model, p)[0] and o.num_cached_tokens == 32


def test_hf_directory_matches_transformers(tiny):
    kind, model, d, _ = tiny
    _check(d, model, kind)


def test_gguf_file_matches_transformers(tiny):
    """llama.cpp's layout: per-layer arrays, the full layers' rotary as rope_freqs factors, no attn_v where the
    values are the keys' projection."""
    kind, model, _, path = tiny
    _check(path, model, kind)


def test_offline_scoring_reads_the_shared_kv(tiny):
    """The offline tools' whole-sequence pass (``model.scoring``: perplexity, calibration) gives each layer its own
    head shape and the sharing layers their source's K/V: its log-probabilities are transformers' (the text's own
    next tokens within 1e-4; over the whole vocabulary float32's rounding through these large random weights
    reaches 2e-4 at a few entries, so the mean is held to 2e-5: a layer reading the wrong K/V moves it by ~1)."""
    from pagedllm.model.scoring import sequence_logprobs

    _, model, d, _ = tiny
    built = model_of(LLM(model=d, max_model_len=128, dtype="float32"))
    ids = PROMPTS[1] + PROMPTS[0]
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = sequence_logprobs(built, ids)
    nxt = torch.tensor(ids[1:])
    assert (got[:-1].gather(1, nxt[:, None]) - ref[:-1].gather(1, nxt[:, None])).abs().max() < 1e-4
    assert (got - ref).abs().mean() < 2e-5


def test_cache_rows_hold_the_widest_layer(tiny):
    """One cache tensor per slot serves the sliding layers (2 heads x 16) and the full ones (2 x 32, or 1 x 32 with
    k = v): a token's row is the widest layer's, the narrower layers use its first values; blocks hold only the
    layers that keep K/V."""
    kind, _, d, _ = tiny
    llm = LLM(model=d, max_model_len=128, dtype="float32")
    kv = llm.engine.core.runner.kv
    width = 64 if kind == "e2b" else 32
    own = 4 if kind == "e2b" else 6  # layers keeping K/V; their groups: 3 sliding + 1 full (e2b), 4 + 2 (k_eq_v)
    slots = 1 if kind == "e2b" else 2
    assert kv.groups.slots == slots and len(kv.slot_caches) == slots
    assert kv.bytes_per_block == 2 * slots * 16 * width * 4
    assert sum(1 for i in range(6) if llm.engine.core.runner.model.cfg.kv_source(i) == i) == own
    k0, k2 = kv.kv_caches[0][0], kv.kv_caches[2][0]
    assert k0.shape[2:] == (2, 16) and k2.shape[2:] == ((2, 32) if kind == "e2b" else (1, 32))
    assert k0.stride(1) == width  # the sliding layer's view: the wide row's first 32 values
    # the simulator lays out the same blocks (the model's own config: its per-layer shapes and shared K/V)
    from pagedllm.sim.cost import Deployment
    from pagedllm.sim.hardware import get_gpu_profile
    from pagedllm.sim.kvcalc import kv_bytes_per_sequence
    from pagedllm.sim.model_profile import SCHEMES, load_model_profile

    profile = load_model_profile(d)
    deployment = Deployment(get_gpu_profile("a100-80gb"), profile, SCHEMES["bf16"], kv_dtype="fp32")
    assert deployment.kv_bytes_per_block(16) == kv.bytes_per_block and len(profile.kv_layers()) == own
    assert kv_bytes_per_sequence(profile, WINDOW, "fp32") == WINDOW * 2 * own * width * 4  # (within the window)
    with pytest.raises(ValueError, match="not split over ranks"):  # the engine's own refusal (tp_layout)
        Deployment(get_gpu_profile("a100-80gb"), profile, SCHEMES["bf16"], tp=2)


def test_quantized_file_runs_from_its_blocks(tmp_path, llm):
    """The linears in Q8_0 blocks (the per-layer-input table requantized to int8): on the float32 path's own
    greedy continuations, the block kernels' logprobs of each token stay within the 8-bit weights' error (this
    random model's top choices are too close for free-running tokens to be compared)."""
    model = _hf_model(llm.engine.core.vocab_size)
    path = str(tmp_path / "q8.gguf")
    _write_gguf(path, model, q8=True)
    ref = LLM(model=path, max_model_len=128, dtype="float32")
    auto = LLM(model=path, max_model_len=128, quantization="gguf", large_step_weights="blocks", dtype="float32")
    lins = model_of(auto).linears()
    assert lins["layers.0.qkv"].kind == "q8-block" and lins["layers.4.ple_gate"].kind == "q8-block"
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for p in PROMPTS:
        text = p + ref.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids
        a, b = (m.generate([text], scored, use_tqdm=False)[0].prompt_logprobs[1:] for m in (auto, ref))
        diffs = [abs(x.logprob - y.logprob) for x, y in zip(a, b)]
        assert len(diffs) == len(text) - 1 and max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.02, diffs


def test_a_per_layer_table_in_blocks_is_looked_up_in_the_file(tmp_path, llm, monkeypatch):
    """Every linear in Q8_0 blocks (32 per-layer values a layer: whole blocks), the default path: the per-layer-input
    table is only looked up, so its blocks stay in the file's memory map (``BlockRows``, as llama.cpp reads the E2B's
    262144 x 8960 table from its mapped file) instead of a packed copy; greedy tokens and logprobs are exactly those
    of the same file with the table packed."""
    from pagedllm.layers.weights import WeightSource
    from pagedllm.worker import plan as runtime_plan
    from pagedllm.worker.autotune import WeightPlan

    # the blocks, not float32 copies (on layers this small the weight plan's timing is a coin toss)
    monkeypatch.setattr(runtime_plan, "choose_plan", lambda *a, **k: WeightPlan(True, 0, 0, "float32", "measured", {}))
    path = str(tmp_path / "ple-q8.gguf")
    _write_gguf(path, _hf_model(llm.engine.core.vocab_size, ple=32), q8=True)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    rows = LLM(model=path, max_model_len=128)
    assert rows.engine.runtime["weights"] == "gguf blocks (auto)"
    table = model_of(rows).linears()["ple_embed"]
    assert table.kind == "gguf-rows" and table.tensors() == [] and table.in_features == 32 * len(TYPES)
    got = rows.generate(PROMPTS, sp, use_tqdm=False)
    monkeypatch.setattr(WeightSource, "lookup_table", lambda self, name: self.linear(name, [name], "embed"))
    packed = LLM(model=path, max_model_len=128)
    assert model_of(packed).linears()["ple_embed"].kind == "q8-block"
    ids = torch.tensor([0, 3, table.out_features - 1])
    assert torch.equal(table.embedding(ids), model_of(packed).linears()["ple_embed"].embedding(ids))
    for g, w in zip(got, packed.generate(PROMPTS, sp, use_tqdm=False)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [lp.logprob for lp in g.outputs[0].logprobs] == [lp.logprob for lp in w.outputs[0].logprobs]


def test_served_through_the_openai_api(tmp_path_factory, llm):
    """The GGUF behind ``pagedllm serve`` with its defaults: /v1/completions' greedy text, whole and streamed, is
    the text of transformers' tokens."""
    model = _hf_model(llm.engine.core.vocab_size)
    path = str(tmp_path_factory.mktemp("gemma4_served") / "tiny-gemma4.gguf")
    _write_gguf(path, model)
    assert_served_greedy_text(tmp_path_factory, path, llm.get_tokenizer().decode(_reference(model, PROMPTS[1])[0]))


def test_what_gemma4_does_not_support_is_refused(tmp_path, llm):
    """Bidirectional attention and tensor parallelism: named."""
    from pagedllm.model.arch import config_from_hf, tp_layout

    base = _hf_model(llm.engine.core.vocab_size).config.to_dict()
    with pytest.raises(ValueError, match="bidirectional"):
        config_from_hf(base | {"use_bidirectional_attention": "all"})
    cfg = config_from_hf(base)
    assert cfg.global_head_dim == 32 and cfg.kv_shared_layers == 2 and cfg.per_layer_input_size == 8
    with pytest.raises(ValueError, match="Gemma 4"):
        tp_layout(cfg, 2)
