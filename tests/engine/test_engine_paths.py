"""Chunked prefill, prefix-cache hits and preemption give the same greedy tokens as a request run alone."""

import pytest

from conftest import ALONE_MAX_TOKENS, PROMPTS
from pagedllm import LLM, SamplingParams

N_NEW = ALONE_MAX_TOKENS  # the shared alone outputs' length (conftest's greedy_alone)
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW)
LONG_PREFIX = (
    "<|im_start|>system\nYou are a meticulous assistant for a shipping company. Always answer in one short "
    "sentence, cite the relevant policy number, and never invent tracking numbers. Policies: 1) refunds within "
    "30 days; 2) free returns for damaged items; 3) express shipping costs extra.<|im_end|>\n<|im_start|>user\n"
)


@pytest.fixture(scope="module")
def alone(greedy_alone):
    """Reference: each prompt alone through the default engine (itself checked against HuggingFace), greedy,
    ``N_NEW`` tokens: conftest's run, which test_hf_reference checks."""
    return {p: o.outputs[0].token_ids for p, o in greedy_alone.items()}


def test_chunked_prefill_tiny_token_budget(alone):
    small = LLM(dtype="float32", max_num_batched_tokens=8, max_num_seqs=4, enable_prefix_caching=False)
    sched = small.engine.core.scheduler
    seen_chunks = []
    orig = sched.schedule

    def spy():
        so = orig()
        assert so.num_batched_tokens <= 8
        seen_chunks.extend(len(s.token_ids) for s in so.scheduled if not s.sample)
        return so

    sched.schedule = spy
    outs = small.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert seen_chunks, "no prompt was split into chunks"
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == alone[p], p


def test_prefix_cache_hit_same_tokens_and_counted(llm, llm_nocache):
    eng = llm.engine
    kv = eng.core.kv_cache_manager
    q0, h0 = kv.prefix_cache_queries, kv.prefix_cache_hits
    p1 = LONG_PREFIX + "Where is my parcel?<|im_end|>\n<|im_start|>assistant\n"
    p2 = LONG_PREFIX + "Can I return a broken lamp?<|im_end|>\n<|im_start|>assistant\n"
    first = llm.generate(p1, GREEDY, use_tqdm=False)[0]
    second = llm.generate(p2, GREEDY, use_tqdm=False)[0]
    again = llm.generate(p2, GREEDY, use_tqdm=False)[0]
    n_prefix = len(eng.tokenizer.encode(LONG_PREFIX))
    bs = eng.config.cache.block_size
    assert second.num_cached_tokens >= (n_prefix // bs) * bs > 0
    assert again.num_cached_tokens == ((len(again.prompt_token_ids) - 1) // bs) * bs
    assert kv.prefix_cache_hits - h0 >= second.num_cached_tokens + again.num_cached_tokens
    assert kv.prefix_cache_queries - q0 == sum(len(o.prompt_token_ids) for o in (first, second, again))
    # the cached paths give exactly the tokens of an engine without prefix caching
    ref = llm_nocache.generate([p1, p2], GREEDY, use_tqdm=False)
    assert first.outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert second.outputs[0].token_ids == ref[1].outputs[0].token_ids
    assert again.outputs[0].token_ids == ref[1].outputs[0].token_ids
    assert llm_nocache.engine.core.kv_cache_manager.prefix_cache_hits == 0


def test_preemption_small_kv_pool(alone):
    # 24 blocks x 16 tokens: 8 concurrent requests of ~20-40 + 48 tokens cannot all fit.
    tight = LLM(dtype="float32", num_gpu_blocks_override=24, max_model_len=256, max_num_seqs=8)
    outs = tight.generate(PROMPTS, GREEDY, use_tqdm=False)
    core = tight.engine.core
    assert core.stats().num_preemptions > 0, "the pool was large enough: no preemption happened"
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == alone[p], p
    core.kv_cache_manager.check_integrity()
    assert core.kv_cache_manager.pool.num_free_blocks == 24


def test_startup_fails_when_max_model_len_does_not_fit():
    with pytest.raises(ValueError, match="max_model_len=1024 needs 64 blocks"):
        LLM(dtype="float32", num_gpu_blocks_override=10, max_model_len=1024)


def test_kv_usage_reported_as_fraction(llm):
    eng = llm.engine
    eng.add_request("usage-probe", PROMPTS[2], SamplingParams(temperature=0, max_tokens=4))
    eng.step()
    usage = eng.core.stats().kv_cache_usage
    assert 0.0 < usage < 1.0
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.core.stats().kv_cache_usage == 0.0


def test_sla_mode_adapts_budget_and_keeps_outputs(alone):
    sla = LLM(dtype="float32", target_tpot_ms=40)
    outs = sla.generate(PROMPTS, GREEDY, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == alone[p], p
    budget = sla.engine.core.stats().token_budget
    assert 16 <= budget < 2048, budget  # measured step times moved it off the static maximum


def test_bfloat16_kv_cache_chunked_and_preempted_match_alone():
    """A bfloat16 KV cache under float32 activations (the default CPU path's cache) keeps the rule: chunked
    prefill, preemption (recompute over its prefix-cached blocks, or swap to host blocks of the cache's dtype and
    back) give each request the greedy tokens it gets alone. The weights are the GGUF blocks at every batch size
    (``--quantization gguf``), which are batch-invariant; the default plan is too where it keeps no dense copy
    (it keeps one for large steps on some CPUs, e.g. the AVX2 build here, whose tokens may then follow the batch)."""
    import torch

    kw = dict(quantization="gguf", kv_cache_dtype="bfloat16")
    alone_llm = LLM(enable_prefix_caching=False, **kw)
    rt = alone_llm.engine.runtime
    assert rt["dtype"] == "float32" and rt["kv_cache_dtype"] == "bfloat16" and "blocks" in rt["weights"], rt
    assert all(k.dtype == torch.bfloat16 for kv in alone_llm.engine.core.runner.kv.kv_caches for k in kv)
    ref = {p: alone_llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS}
    del alone_llm
    for mode in ("recompute", "swap"):
        tight = LLM(num_gpu_blocks_override=24, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
                    preemption_mode=mode, swap_space=0.25, **kw)
        outs = tight.generate(PROMPTS, GREEDY, use_tqdm=False)
        core = tight.engine.core
        st = core.stats()
        assert st.num_preemptions > 0, "the pool was large enough: no preemption happened"
        assert mode == "recompute" or st.num_swap_outs > 0, st
        for p, o in zip(PROMPTS, outs):
            assert o.outputs[0].token_ids == ref[p], (mode, p)
        core.kv_cache_manager.check_integrity()
        del tight


def test_8_bit_activations_batched_chunked_match_alone():
    """``--activation-bits 8`` on the default path (packed GGUF blocks): every block linear runs one activation
    level, /health says so, the logprobs move off the 16-bit engine's (the flag takes effect) and a request's greedy
    tokens are the same alone as batched with chunked prefill."""
    from helpers import model_of

    sp = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1)
    eight = LLM(activation_bits=8, enable_prefix_caching=False)
    assert eight.engine.runtime["activation_bits"] == 8
    levels = {lin.act_levels for lin in model_of(eight).linears().values() if hasattr(lin, "act_levels")}
    assert levels == {1}
    alone8 = [eight.generate(p, sp, use_tqdm=False)[0].outputs[0] for p in PROMPTS[:4]]
    batched = LLM(activation_bits=8, enable_prefix_caching=False, max_num_batched_tokens=16, max_num_seqs=4)
    for a, b in zip(alone8, batched.generate(PROMPTS[:4], sp, use_tqdm=False)):
        assert b.outputs[0].token_ids == a.token_ids
    sixteen = LLM(enable_prefix_caching=False).generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0]
    assert sixteen.logprobs[0] != alone8[0].logprobs[0]
    with pytest.raises(ValueError, match="activation_bits"):
        LLM(activation_bits=4)


def test_mlp_in_row_pieces_equals_one_call():
    """The fused CPU path runs a long step's MLP in pieces of ``mlp_rows`` rows (bounded activations, reused from
    the heap): on the default path's packed blocks, the same numbers as one call over all rows, and each row as it
    is alone."""
    import torch

    from helpers import model_of
    from pagedllm.layers.mlp import GatedMLP
    from pagedllm.layers.ops import FusedOps

    model = model_of(LLM(enable_prefix_caching=False, large_step_weights="blocks"))  # not the bf16 stripes
    ops = model.ops
    assert ops.fused
    mlp = model.layers[0].mlp
    assert hasattr(mlp.gate_up, "act_levels") and hasattr(mlp.down, "act_levels")  # block linears
    torch.manual_seed(0)
    x = torch.randn(ops.mlp_rows + 45, model.cfg.hidden_size)
    calls = []

    def counted(rows):
        calls.append(rows.shape[0])
        return mlp.gate_up(rows)

    pieces = GatedMLP(counted, mlp.down, mlp.act)(x, ops)
    assert calls == [ops.mlp_rows, 45]
    whole_ops = FusedOps(ops.kernels)
    whole_ops.mlp_rows = 10**6
    whole = mlp(x, whole_ops)
    assert torch.equal(pieces, whole)
    assert torch.equal(mlp(x[-1:], ops), whole[-1:])
