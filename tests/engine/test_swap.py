"""Swap preemption: a victim's KV blocks go to a host-side pool and come back; output unchanged, no leaks."""

import pytest

from conftest import ALONE_MAX_TOKENS, PROMPTS
from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=ALONE_MAX_TOKENS)


@pytest.fixture(scope="module")
def alone(greedy_alone):
    """Each prompt's greedy tokens alone on the float32 engine (conftest's run, checked against HuggingFace)."""
    return [greedy_alone[p].outputs[0].token_ids for p in PROMPTS]


def test_swap_preemption_identical_and_no_leaks(alone):
    tight = LLM(dtype="float32", num_gpu_blocks_override=24, max_model_len=256, max_num_seqs=8, preemption_mode="swap",
                swap_space=0.25)
    outs = tight.generate(PROMPTS, GREEDY, use_tqdm=False)
    core = tight.engine.core
    st = core.stats()
    assert st.num_swap_outs > 0 and st.num_swap_ins == st.num_swap_outs, st
    assert [o.outputs[0].token_ids for o in outs] == alone
    kv = core.kv_cache_manager
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.num_blocks
    assert core.scheduler.host_pool.num_free == core.scheduler.host_pool.num_blocks


def test_swap_falls_back_to_recompute_when_host_pool_is_full(alone):
    tight = LLM(dtype="float32", num_gpu_blocks_override=24, max_model_len=256, max_num_seqs=8, preemption_mode="swap",
                num_host_blocks_override=3)
    outs = tight.generate(PROMPTS, GREEDY, use_tqdm=False)
    st = tight.engine.core.stats()
    assert st.num_preemptions > st.num_swap_outs  # some victims did not fit in 3 host blocks: recomputed
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert tight.engine.core.scheduler.host_pool.num_free == 3


def test_swap_needs_swap_space():
    with pytest.raises(ValueError, match="swap"):
        LLM(dtype="float32", preemption_mode="swap", swap_space=0)
