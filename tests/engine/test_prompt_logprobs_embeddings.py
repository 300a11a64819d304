"""Prompt logprobs and embeddings (pooling) through the engine: equal to transformers' on the same weights, and
unchanged by chunked prefill, prefix-cache hits (which such requests bypass) and preemption."""

import pytest
import torch

from pagedllm import LLM, SamplingParams
from conftest import PROMPTS

LONG = PROMPTS[1] + PROMPTS[2] + PROMPTS[4]  # ~50 tokens: several 16-token chunks


@pytest.fixture(scope="module")
def hf_rows(hf_model):
    """prompt token ids -> (log-softmax over the vocabulary at every position, final hidden states)."""
    _, model = hf_model
    cache = {}

    def run(ids: list[int]):
        key = tuple(ids)
        if key not in cache:
            with torch.inference_mode():
                out = model(torch.tensor([ids]), output_hidden_states=True)
            cache[key] = torch.log_softmax(out.logits[0].float(), dim=-1), out.hidden_states[-1][0].float()
        return cache[key]

    return run


@pytest.fixture(scope="module")
def chunked():
    """Small steps (16 tokens: every prompt is chunked), prefix caching on, mean pooling by default (--pooling)."""
    return LLM(dtype="float32", max_num_batched_tokens=16, max_model_len=512, pooling="mean")


def check_prompt_logprobs(out, hf_rows, k: int) -> None:
    ids = out.prompt_token_ids
    ref, _ = hf_rows(ids)
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        lp = plp[i]
        assert lp.token_id == ids[i]
        assert lp.logprob == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert abs(lp.rank - (int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1)) <= 1  # ties may swap
        top = ref[i - 1].topk(k)
        assert len(lp.top) == k
        assert [t.logprob for t in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_prompt_logprobs_match_hf_chunked_and_after_cache_fill(chunked, hf_rows):
    prompts = [PROMPTS[0], LONG]
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    chunked.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # fill the prefix cache
    hits_before = chunked.engine.core.kv_cache_manager.prefix_cache_hits
    outs = chunked.generate(prompts, sp, use_tqdm=False)
    for o in outs:
        check_prompt_logprobs(o, hf_rows, 3)
        assert o.num_cached_tokens == 0  # the prompt was computed, not taken from the cache
    assert chunked.engine.core.kv_cache_manager.prefix_cache_hits == hits_before
    # sampling settings do not change prompt logprobs (they are the model's)
    hot = chunked.generate([LONG], SamplingParams(temperature=1.5, top_k=5, max_tokens=2, prompt_logprobs=0, seed=1),
                           use_tqdm=False)[0]
    assert [lp.logprob for lp in hot.prompt_logprobs[1:]] == pytest.approx(
        [lp.logprob for lp in outs[1].prompt_logprobs[1:]], abs=1e-4)  # batched apart: float sums differ
    assert all(lp.top == [] for lp in hot.prompt_logprobs[1:])
    # without prompt_logprobs nothing is computed or returned
    plain = chunked.generate([LONG], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_prompt_logprobs_survive_preemption(hf_rows):
    tight = LLM(dtype="float32", num_gpu_blocks_override=14, max_model_len=128, max_num_seqs=8,
                max_num_batched_tokens=32)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    outs = tight.generate(PROMPTS, sp, use_tqdm=False)
    assert tight.engine.core.stats().num_preemptions > 0, "the pool was large enough: no preemption happened"
    for o in outs:
        check_prompt_logprobs(o, hf_rows, 1)


def test_embeddings_match_hf_last_mean_cls(chunked, hf_rows):
    prompts = [PROMPTS[0], LONG]
    chunked.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # cached prefixes
    last = chunked.embed(prompts, pooling="last", normalize=False, use_tqdm=False)
    mean = chunked.embed(prompts, normalize=False, use_tqdm=False)  # the engine's default: pooling="mean"
    cls = chunked.embed(prompts, pooling="cls", normalize=False, use_tqdm=False)
    unit = chunked.embed(prompts, pooling="last", use_tqdm=False)
    for o_last, o_mean, o_cls, o_unit in zip(last, mean, cls, unit):
        _, hidden = hf_rows(o_last.prompt_token_ids)
        assert o_last.outputs[0].token_ids == [] and o_last.outputs[0].finish_reason == "stop"
        assert torch.allclose(torch.tensor(o_last.embedding), hidden[-1], atol=1e-4)
        assert torch.allclose(torch.tensor(o_mean.embedding), hidden.mean(dim=0), atol=1e-4)
        assert torch.allclose(torch.tensor(o_cls.embedding), hidden[0], atol=1e-4)
        assert o_mean.num_cached_tokens == o_cls.num_cached_tokens == 0  # they read from the start: no cache hits
        u = torch.tensor(o_unit.embedding)
        assert u.norm().item() == pytest.approx(1.0, abs=1e-5)
        assert torch.allclose(u, hidden[-1] / hidden[-1].norm(), atol=1e-5)
    assert last[0].num_cached_tokens > 0 or len(last[0].prompt_token_ids) <= 16  # last pooling may use the cache
    kv = chunked.engine.core.kv_cache_manager
    kv.check_integrity()
    assert not chunked.engine.has_unfinished_requests()


def test_embedding_and_generation_batched_together(chunked):
    """Embedding requests share steps with generating ones without changing either."""
    alone_tokens = chunked.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    alone_vec = chunked.embed([PROMPTS[3]], pooling="last", normalize=False, use_tqdm=False)[0].embedding
    eng = chunked.engine
    eng.add_tokenized_request("g", *eng.encode_prompt(PROMPTS[2]), SamplingParams(temperature=0, max_tokens=8))
    eng.add_tokenized_request("e", *eng.encode_prompt(PROMPTS[3]), SamplingParams(max_tokens=1, pooling="last"))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done["g"].outputs[0].token_ids == alone_tokens.outputs[0].token_ids
    assert done["e"].embedding == pytest.approx(alone_vec, abs=1e-4)


@pytest.mark.parametrize("kw, needle", [
    (dict(pooling="max"), "pooling"),
    (dict(pooling="last", n=2), "samples nothing"),
    (dict(pooling="last", logprobs=1), "samples nothing"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
])
def test_bad_params(kw, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kw)
