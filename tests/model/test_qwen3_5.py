"""Qwen 3.5, the first hybrid: Gated DeltaNet layers (a recurrent state per sequence) beside full-attention layers
(output gate, partial rotary). Tiny random models from transformers' own config, saved as an HF directory and
written as GGUF the way llama.cpp's converter writes them (A as -exp(A_log), the convolution squeezed, 1 + w norms
but the DeltaNet's, value heads tiled over the key heads); against transformers in float32 on both backends: alone,
batched with 16-token chunks, under preemption, and with prefix-cache hits that restore a state snapshot."""

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from helpers import add_default_vocab, gguf_add, gguf_finish, gguf_stacked_experts, model_of, save_hf_and_gguf
from test_architectures import MAX_TOKENS, PROMPTS, assert_both_backends_match, _reference

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _hf_model(vocab: int, moe: bool = False, qwen3_next: bool = False):
    import transformers as tf

    torch.manual_seed(0)
    # 4 layers (3 DeltaNet, 1 attention), 4 value heads over 2 key heads, rotary on 8 of 32 dimensions; the MoE
    # variant: 4 experts of 32, 2 per token, a shared expert of 48
    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  eos_token_id=2, bos_token_id=1, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    if qwen3_next:  # Qwen 3.5 MoE's layers with the DeltaNet's projections interleaved per key head
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                           moe_intermediate_size=32,
                                                           shared_expert_intermediate_size=48))
    elif moe:
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                                 moe_intermediate_size=32,
                                                                 shared_expert_intermediate_size=48))
    else:
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**common, intermediate_size=128))
    with torch.no_grad():
        for p in model.parameters():  # larger weights: confident greedy choices; norms not all 1 (or 0)
            p.mul_(8.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.config._attn_implementation = "eager"
    return model.eval()


def _tiled(t: np.ndarray, axis: int, nk: int, r: int, d: int) -> np.ndarray:
    """llama.cpp's value-head order: grouped by key head (HF) -> tiled over the key heads."""
    shape = list(t.shape)
    t = t.reshape(*shape[:axis], nk, r, d, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(t, axis, axis + 1)).reshape(shape)


def _write_gguf(path: str, model, q8: bool = False) -> None:
    c = model.config
    moe = hasattr(c, "num_experts")
    nxt = c.model_type == "qwen3_next"  # llama.cpp's qwen3next: value heads grouped, qkvz split, ba interleaved
    arch = "qwen3next" if nxt else "qwen35moe" if moe else "qwen35"
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    if moe:  # as llama.cpp's converter: the experts' sizes, stacked experts, the shared expert and its gate
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    else:
        w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_full_attention_interval(4)  # (layer types linear, linear, linear, full)
    add_default_vocab(w, c.bos_token_id, c.eos_token_id)
    names = gguf.get_tensor_name_map({"qwen3next": gguf.MODEL_ARCH.QWEN3NEXT, "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE,
                                      "qwen35": gguf.MODEL_ARCH.QWEN35}[arch], c.num_hidden_layers)
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = nv // nk
    for name, t in model.state_dict().items():
        t = t.float().numpy()
        if gguf_stacked_experts(w, name, t):
            continue
        base, _, suffix = name.rpartition(".")
        if name.endswith(".A_log"):
            base, suffix, t = name, "", -np.exp(t)
        elif name.endswith(".dt_bias"):
            base, suffix = name.replace("dt_bias", "dt_proj"), "bias"
        elif "conv1d" in name:
            t = t.reshape(t.shape[0], -1)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1.0
        if "in_proj_qkvz" in name:  # per key head [q, k, v, z] -> attn_qkv [q..., k..., v...] and attn_gate [z...]
            q, k, v, z = np.split(t.reshape(nk, -1, t.shape[1]), np.cumsum([dk, dk, r * dv])[:3], axis=1)
            i = name.split(".")[2]
            w.add_tensor(f"blk.{i}.attn_qkv.weight", np.ascontiguousarray(
                np.concatenate([x.reshape(-1, t.shape[1]) for x in (q, k, v)]), dtype=np.float32))
            w.add_tensor(f"blk.{i}.attn_gate.weight", np.ascontiguousarray(z.reshape(-1, t.shape[1]), np.float32))
            continue
        if "linear_attn." in name and not nxt:  # value heads tiled over the key heads
            if "in_proj_qkv" in name:
                t = np.concatenate([t[:2 * nk * dk], _tiled(t[2 * nk * dk:], 0, nk, r, dv)])
            elif "conv1d" in name:
                t = np.concatenate([t[:2 * nk * dk], _tiled(t[2 * nk * dk:], 0, nk, r, dv)])
            elif "in_proj_z" in name:
                t = _tiled(t, 0, nk, r, dv)
            elif "in_proj_a" in name or "in_proj_b" in name or "A_log" in name or "dt_bias" in name:
                t = _tiled(t, 0, nk, r, 1)
            elif "out_proj" in name:
                t = _tiled(t, 1, nk, r, dv)
        out = names.get_name(base) + (f".{suffix}" if suffix else "")
        gguf_add(w, out, t, q8 and t.ndim == 2 and "conv1d" not in name)
    gguf_finish(w)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, llm):
    """(the HF model, its directory, the GGUF file)."""
    model = _hf_model(llm.engine.core.vocab_size)
    d, path = save_hf_and_gguf(tmp_path_factory.mktemp("qwen3_5"), llm, model, _write_gguf, "tiny-qwen35")
    return model, str(d), path


def _check(path: str, model, arch: str = "qwen35", types=("linear",) * 3 + ("full",),
           mixers=("GatedDeltaNet", "Attention")):
    alone = LLM(model=path, max_model_len=512, dtype="float32", enable_prefix_caching=False)
    built = model_of(alone)
    assert built.cfg.arch == arch and built.cfg.layer_types == types
    assert {type(la.attn).__name__ for la in built.layers} == set(mixers)
    assert_both_backends_match(alone, model)
    del alone
    # batched, 16-token chunks, a shared prefix and a KV cache too small for all at once (preemption): same tokens
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    block_bytes = 16 * 2 * c.num_key_value_heads * head_dim * 4 * types.count("full")  # the attention layers
    busy = LLM(model=path, max_model_len=128, dtype="float32", max_num_batched_tokens=16,
               kv_cache_memory=8 * block_bytes)
    prompts = PROMPTS + [PROMPTS[1] + [7, 8, 9], PROMPTS[2][:20], PROMPTS[1] + [7, 8, 9, 10]]
    outs = busy.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _reference(model, p)[0], p
    sched = busy.engine.core.scheduler
    assert sched.counters.num_preemptions > 0
    slots = busy.engine.kv_state()["state_slots"]
    assert busy.engine.kv_state()["consistent"] and slots["num_held"] == 0 and slots["num_free"] == slots["num_slots"]
    # a prompt that extends an earlier one restores the state saved at that one's last block boundary
    before = sched.kv.prefix_cache_hits
    for p in (PROMPTS[1] + [5] * 30, PROMPTS[1] + [9] * 3):
        o = busy.generate([p], GREEDY, use_tqdm=False)[0]
        assert o.outputs[0].token_ids == _reference(model, p)[0], p
        assert o.num_cached_tokens == 32  # two of PROMPTS[1]'s blocks: its prefix not recomputed
    assert sched.kv.prefix_cache_hits - before == 64


def test_moe_with_a_shared_expert_matches_transformers(tmp_path, llm):
    """Qwen 3.5 MoE: the same hybrid layers, experts (top 2 of 4) and a gated shared expert in every layer; as an
    HF directory and as llama.cpp's GGUF (experts stacked, the shared expert's ``_shexp`` tensors)."""
    model = _hf_model(llm.engine.core.vocab_size, moe=True)
    d, path = save_hf_and_gguf(tmp_path, llm, model, _write_gguf, "tiny-qwen35moe")
    for src in (str(d), path):
        _check(src, model, "qwen35moe")


def test_qwen3_next_matches_transformers(tmp_path, llm):
    """Qwen3-Next: the same layers with the DeltaNet's projections interleaved per key head (``in_proj_qkvz``,
    ``in_proj_ba``), reordered at load; as an HF directory and as llama.cpp's GGUF (qkvz split by the converter,
    ba still interleaved, value heads grouped)."""
    model = _hf_model(llm.engine.core.vocab_size, qwen3_next=True)
    d, path = save_hf_and_gguf(tmp_path, llm, model, _write_gguf, "tiny-qwen3next")
    for src in (str(d), path):
        _check(src, model, "qwen3next")


def test_hf_directory_matches_transformers(tiny):
    model, d, _ = tiny
    _check(d, model)


def test_gguf_file_matches_transformers(tiny):
    """llama.cpp's conventions, value heads tiled over the key heads included."""
    model, _, path = tiny
    from pagedllm.model.loader import load_gguf

    cfg, _ = load_gguf(path)
    assert cfg.linear_v_tiled and cfg.rotary_dim == 8 and cfg.attn_output_gate
    _check(path, model)


def test_quantized_file_runs_from_its_blocks(tiny, tmp_path):
    """Every linear in Q8_0 blocks (the attention's q rows with their gates reordered in the packed codes): the
    block kernels' tokens and logprobs follow the float32 path's on the same file."""
    model = tiny[0]
    path = str(tmp_path / "q8.gguf")
    _write_gguf(path, model, q8=True)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    ref = LLM(model=path, max_model_len=128, dtype="float32").generate(PROMPTS, sp, use_tqdm=False)
    auto = LLM(model=path, max_model_len=128, quantization="gguf", large_step_weights="blocks")
    lins = model_of(auto).linears()
    assert lins["layers.0.in_proj"].kind == "q8-block" and lins["layers.3.qkv"].kind == "q8-block"
    for g, r in zip(auto.generate(PROMPTS, sp, use_tqdm=False), ref):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, r.outputs[0].logprobs):
            assert abs(a.logprob - b.logprob) < 0.02


def test_swap_preemption_carries_the_state(tiny):
    """``--preemption-mode swap``: a preempted sequence's recurrent state is copied to host memory with its KV
    blocks and back when it resumes (not recomputed): the same tokens as alone, swaps counted, nothing leaked."""
    model, _, path = tiny
    c = model.config
    block_bytes = 16 * 2 * c.num_key_value_heads * c.head_dim * 4  # the one attention layer
    busy = LLM(model=path, max_model_len=128, dtype="float32", max_num_batched_tokens=16, preemption_mode="swap",
               swap_space=0.05, kv_cache_memory=8 * block_bytes, enable_prefix_caching=False)
    prompts = PROMPTS + [PROMPTS[1] + [7, 8, 9], PROMPTS[2][:20]]
    outs = busy.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _reference(model, p)[0], p
    counters = busy.engine.core.scheduler.counters
    assert counters.num_swap_outs > 0 and counters.num_swap_ins == counters.num_swap_outs
    assert counters.num_preemptions_recompute == 0
    state = busy.engine.kv_state()
    assert state["consistent"] and state["state_slots"]["num_held"] == 0


def test_what_the_recurrent_state_does_not_support_is_refused(tiny):
    """A draft model with recurrent-state layers (its states are not rewound after rejections; the target's are:
    test_hybrid_speculative.py) and tensor parallelism stop with their names."""
    from pagedllm.model.arch import tp_layout
    from pagedllm.model.loader import load_gguf

    _, d, path = tiny
    with pytest.raises(ValueError, match="the draft model .* has recurrent-state layers"):
        LLM(max_model_len=128, speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    cfg, _ = load_gguf(path)
    with pytest.raises(ValueError, match="linear-attention"):
        tp_layout(cfg, 2)


def test_serves_through_the_openai_api(tiny, tmp_path_factory, llm):
    """The GGUF file behind the server with its defaults: /v1/completions' greedy text, whole and streamed, is
    the text of transformers' tokens; the second request with the same prompt restores the first one's state
    snapshot (a prefix hit in the metrics); /debug/kv and /metrics show the state slots, all free at the end."""
    import httpx
    import openai

    from helpers import scrape, start_server

    model, _, path = tiny
    want = llm.get_tokenizer().decode(_reference(model, PROMPTS[1])[0])
    proc, base, _ = start_server(tmp_path_factory, "--model", path, "--served-model-name", "qwen35")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        kw = dict(model="qwen35", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
        assert client.completions.create(**kw).choices[0].text == want
        assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == want
        kv = httpx.get(base + "/debug/kv").json()
        slots = kv["state_slots"]
        assert kv["consistent"] and slots["num_held"] == 0 and slots["num_free"] == slots["num_slots"] > 0
        assert slots["num_snapshots"] == 1 and slots["bytes_per_slot"] > 0
        m = scrape(base)
        assert m["pagedllm:prefix_cache_hits_total"] == 32  # the second request: two blocks' state restored
        assert m["pagedllm:recurrent_state_slots"] == slots["num_slots"]
        assert m["pagedllm:recurrent_state_snapshots"] == 1
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_step_failing_after_the_state_update_reruns_the_others_from_their_first_token(tiny):
    """A step that raises after its forward ran (the states of every sequence in it already advanced): the engine
    re-runs its requests one at a time, each from its first token on a zeroed state, so the innocent requests'
    greedy tokens stay the reference's; the failing one ends with an error."""
    model, d, _ = tiny
    llm = LLM(model=d, max_model_len=128, dtype="float32")
    eng, bad = llm.engine, 777
    runner = eng.core.runner
    forward = runner._forward_step

    def fails_after_the_forward(step, *args, **kwargs):
        out = forward(step, *args, **kwargs)
        if bad in step.input_ids:
            raise RuntimeError("injected fault after the forward")
        return out

    runner._forward_step = fails_after_the_forward
    for i, p in enumerate(PROMPTS[:2]):
        eng.add_request(f"ok{i}", p, GREEDY)
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}

    def step():
        for o in eng.step():
            tokens[o.request_id] = o.outputs[0].token_ids
            if o.finished:
                finish[o.request_id] = o.outputs[0].finish_reason

    for _ in range(4):  # the two requests decode a few tokens first: their states hold something
        step()
    eng.add_request("bad", [bad] + PROMPTS[2], GREEDY)
    while eng.has_unfinished_requests():
        step()
    for i, p in enumerate(PROMPTS[:2]):
        assert tokens[f"ok{i}"] == _reference(model, p)[0], i
    assert finish["bad"] == "error"
    assert eng.kv_state()["consistent"] and eng.kv_state()["state_slots"]["num_held"] == 0


def test_offline_scoring_runs_the_state_layers(tiny):
    """The offline tools' whole-sequence pass (``model.scoring``: perplexity, calibration) gives a hybrid's state
    layers a private zeroed state: its log-probabilities are transformers'."""
    from pagedllm.model.scoring import sequence_logprobs

    model, d, _ = tiny
    built = model_of(LLM(model=d, max_model_len=128, dtype="float32"))
    ids = PROMPTS[1] + PROMPTS[0]
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert (sequence_logprobs(built, ids) - ref).abs().max() < 1e-4


def test_state_pools_are_capped_and_requests_wait_for_a_slot(tiny, monkeypatch):
    """The state pools hold at most ``STATE_POOL_BYTES`` (here 5 slots' worth): more prompts than slots still all
    finish with the reference's tokens, never more sequences running than slots, nothing leaked."""
    from pagedllm import config

    model, _, path = tiny
    probe = LLM(model=path, max_model_len=128, dtype="float32")
    per_slot = probe.engine.core.runner.kv.state_bytes_per_slot
    del probe
    monkeypatch.setattr(config, "STATE_POOL_BYTES", 5 * per_slot)
    capped = LLM(model=path, max_model_len=128, dtype="float32")
    runner = capped.engine.core.runner
    assert runner.num_state_slots == 5 and runner.state_live_slots == 3
    prompts = [PROMPTS[1][i:] + [i + 7] for i in range(8)]  # (no 0: the reference reads it as padding)
    outs = capped.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _reference(model, p)[0], p
    slots = capped.engine.kv_state()["state_slots"]
    assert slots["num_slots"] == 5 and slots["num_held"] == 0
