"""Speculative decoding inside continuous batching: greedy identity, acceptance, rollback, block accounting."""

import json

import pytest
import torch

from conftest import PROMPTS
from pagedllm import LLM, SamplingParams

N_NEW = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW)
CODE = (
    "Rewrite this function with one change: rename total to result.\n\n"
    "def add_all(values):\n    total = 0\n    for v in values:\n        total = total + v\n    return total\n\n"
    "Rewritten:\n\ndef add_all(values):\n"
)
SPEC_PROMPTS = PROMPTS + [CODE]


@pytest.fixture(scope="module")
def reference(llm):
    return {p: o.outputs[0].token_ids for p, o in zip(SPEC_PROMPTS, llm.generate(SPEC_PROMPTS, GREEDY, use_tqdm=False))}


def _check_identity(llm, reference):
    outs = llm.generate(SPEC_PROMPTS, GREEDY, use_tqdm=False)
    for p, o in zip(SPEC_PROMPTS, outs):
        assert o.outputs[0].token_ids == reference[p], p
    core = llm.engine.core
    core.kv_cache_manager.check_integrity()
    assert core.kv_cache_manager.pool.num_free_blocks == core.kv_cache_manager.num_blocks
    return core.stats()


def test_ngram_greedy_identity_batched(reference):
    llm = LLM(dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    st = _check_identity(llm, reference)
    assert st.spec_num_drafts > 0 and st.spec_num_accepted_tokens > 0
    assert st.spec_num_accepted_tokens < st.spec_num_draft_tokens  # some drafts were rejected and rolled back
    # the code-rewrite prompt repeats its input: most of its drafts are accepted
    code = llm.generate(CODE, GREEDY, use_tqdm=False)[0]
    assert code.outputs[0].token_ids == reference[CODE]


def test_ngram_with_chunked_prefill_and_preemption(reference):
    llm = LLM(dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              max_num_batched_tokens=24, num_gpu_blocks_override=20, max_model_len=256)
    st = _check_identity(llm, reference)
    assert st.num_preemptions > 0, "the pool was large enough: no preemption happened"
    assert st.spec_num_drafts > 0


def test_self_draft_accepts_nearly_everything_with_chunking_and_preemption(reference):
    """The model drafting for itself: every draft should be accepted, so a broken verifier cannot pass."""
    llm = LLM(dtype="float32", speculative_config={"method": "draft_model", "model": "default", "num_speculative_tokens": 3},
              max_num_batched_tokens=32, num_gpu_blocks_override=24, max_model_len=256)
    st = _check_identity(llm, reference)
    assert st.num_preemptions > 0
    assert st.spec_num_draft_tokens > 100
    assert st.spec_num_accepted_tokens / st.spec_num_draft_tokens > 0.95


def test_random_verification_path_with_top_k_1_equals_greedy(reference):
    """temperature > 0 goes through rejection sampling; top_k=1 makes the target one-hot, so it must give the
    greedy tokens exactly."""
    llm = LLM(dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outs = llm.generate(SPEC_PROMPTS, SamplingParams(temperature=0.8, top_k=1, max_tokens=N_NEW, seed=3),
                        use_tqdm=False)
    for p, o in zip(SPEC_PROMPTS, outs):
        assert o.outputs[0].token_ids == reference[p], p
    assert llm.engine.core.stats().spec_num_accepted_tokens > 0
    # seeded sampling with speculation is reproducible
    sp = SamplingParams(temperature=1.0, max_tokens=32, seed=11)
    a = llm.generate(CODE, sp, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(CODE, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and len(a) == 32


def test_aborts_with_drafts_leak_no_blocks():
    llm = LLM(dtype="float32", speculative_config={"method": "draft_model", "model": "default", "num_speculative_tokens": 4})
    eng = llm.engine
    for i, p in enumerate(SPEC_PROMPTS):
        eng.add_request(f"a{i}", p, SamplingParams(temperature=0.7, max_tokens=60, seed=i))
    for _ in range(6):
        eng.step()
    assert eng.core.stats().spec_num_drafts > 0
    for i in range(0, len(SPEC_PROMPTS), 2):
        eng.abort_request(f"a{i}")
    while eng.has_unfinished_requests():
        eng.step()
    kv = eng.core.kv_cache_manager
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_disable_by_batch_size():
    cfg = {"method": "ngram", "num_speculative_tokens": 4}
    off = LLM(dtype="float32", speculative_config=cfg, speculative_disable_by_batch_size=1)
    off.generate([CODE, PROMPTS[0]], GREEDY, use_tqdm=False)
    assert off.engine.core.stats().spec_num_drafts == 0


def test_bad_speculative_configs(tmp_path):
    with pytest.raises(ValueError, match="speculative method"):
        LLM(dtype="float32", speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="needs 'model'"):
        LLM(dtype="float32", speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(dtype="float32", speculative_config="{method: ngram")
    with pytest.raises(ValueError, match="needs --speculative-config"):
        LLM(dtype="float32", speculative_disable_by_batch_size=4)
    # a draft with another vocabulary: a tiny llama in HF layout (config.json + safetensors)
    from safetensors.torch import save_file

    d = tmp_path / "tiny"
    d.mkdir()
    cfg = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 128,
           "max_position_embeddings": 8192, "tie_word_embeddings": True, "eos_token_id": 2}
    (d / "config.json").write_text(json.dumps(cfg))
    t = {"model.embed_tokens.weight": torch.randn(100, 64), "model.norm.weight": torch.ones(64),
         "model.layers.0.input_layernorm.weight": torch.ones(64),
         "model.layers.0.post_attention_layernorm.weight": torch.ones(64),
         "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
         "model.layers.0.self_attn.k_proj.weight": torch.randn(32, 64),
         "model.layers.0.self_attn.v_proj.weight": torch.randn(32, 64),
         "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 64),
         "model.layers.0.mlp.gate_proj.weight": torch.randn(128, 64),
         "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64),
         "model.layers.0.mlp.down_proj.weight": torch.randn(64, 128)}
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="does not share the target's vocabulary"):
        LLM(dtype="float32", speculative_config={"method": "draft_model", "model": str(d), "num_speculative_tokens": 2})


def test_server_with_speculation_reports_spec_metrics(tmp_path_factory, reference):
    import httpx

    from helpers import start_server

    cfg = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    proc, base, log = start_server(tmp_path_factory, "--speculative-config", cfg)
    try:
        r = httpx.post(base + "/v1/completions", json={"prompt": CODE, "max_tokens": N_NEW, "temperature": 0},
                       timeout=120).json()
        metrics = httpx.get(base + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert r["usage"]["completion_tokens"] == len(reference[CODE])
    vals = {l.split("{")[0]: float(l.rsplit(" ", 1)[1]) for l in metrics.splitlines()
            if l.startswith("pagedllm:spec_decode") and "{" in l and "_created" not in l}
    assert vals["pagedllm:spec_decode_num_drafts_total"] > 0
    assert 0 < vals["pagedllm:spec_decode_num_accepted_tokens_total"] <= vals["pagedllm:spec_decode_num_draft_tokens_total"]
    assert "pagedllm:spec_decode_num_accepted_tokens_per_pos_total" in vals
