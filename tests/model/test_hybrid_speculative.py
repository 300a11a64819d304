"""Speculative decoding on hybrids (recurrent-state layers beside attention): a verify step advances each state
over every draft; after a rejection the runner puts back the states the sequence had before the step and runs its
state layers again over the accepted rows (their inputs kept by the forward pass), so the states end where its KV
cache does. Greedy tokens must be those of the model alone — a state left past a rejected draft changes every
later token. Tiny random Qwen 3.5 (Gated DeltaNet), LFM2 (short convolutions) and Granite 4.0-H (Mamba-2)."""

import pytest

from helpers import model_of
from pagedllm import LLM, SamplingParams
from pagedllm.layers.ops import TorchOps
from test_granite_hybrid import _hf_model as granite_model
from test_lfm2 import _hf_model as lfm2_model
from test_qwen3_5 import _hf_model as qwen35_model

FAMILIES = {"qwen35": qwen35_model, "lfm2": lfm2_model, "granite": granite_model}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
# token ids (no 0: the reference reads it as padding)
PROMPTS = [[(i * 37) % 5000 + 100 for i in range(24)] * 2, [7, 8, 9, 10, 11] * 6, [(i * 91) % 3000 + 50 for i in range(40)],
           [300 + i % 7 for i in range(30)]]


def _hybrid(family: str, tmp_path_factory, llm) -> tuple[str, list]:
    """(the HF directory, each prompt's greedy tokens from the model alone)."""
    d = tmp_path_factory.mktemp(family)
    model = FAMILIES[family](llm.engine.core.vocab_size)
    model.save_pretrained(d, safe_serialization=True)
    llm.get_tokenizer().save_pretrained(d)
    alone = LLM(model=str(d), dtype="float32", max_model_len=256)
    return str(d), [o.outputs[0].token_ids for o in alone.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hybrid(request, tmp_path_factory, llm):
    return _hybrid(request.param, tmp_path_factory, llm)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory, llm):
    return _hybrid("qwen35", tmp_path_factory, llm)


def _check(d: str, want: list, spec: dict, torch_ops: bool = False, **kw):
    """``PROMPTS`` batched through ``d`` with speculation ``spec``: the tokens of the model alone, nothing left
    held; with ``torch_ops`` again on torch's operations (CUDA's path: the chunked rule) after the fused kernels."""
    llm = LLM(model=d, dtype="float32", speculative_config=spec, **({"max_model_len": 256} | kw))
    built = model_of(llm)
    for ops in (built.ops, TorchOps()) if torch_ops else (built.ops,):
        built.ops = ops
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for p, o, w in zip(PROMPTS, outs, want):
            assert o.outputs[0].token_ids == w, (p, type(ops).__name__)
    st = llm.engine.core.stats()
    state = llm.engine.kv_state()
    assert state["consistent"] and state["state_slots"]["num_held"] == 0
    return st


def test_every_number_of_accepted_drafts_rewinds_to_the_right_token(hybrid, monkeypatch):
    """An oracle proposer (the model's own continuation, one draft made wrong at a position that cycles, every
    fourth proposal all right): verify steps that accept 0, 1, 2 and all 3 drafts, in one batch."""
    from pagedllm.spec.proposer import NgramProposer

    d, want = hybrid
    ref = {tuple(p): w for p, w in zip(PROMPTS, want)}
    calls = []

    def oracle(self, budget, requests, so):
        out = {}
        for rid, k in budget.items():
            st = requests[rid]
            n = len(st.output_token_ids)
            drafts = list(ref[tuple(st.prompt_token_ids)][n:n + k])
            wrong = len(calls) % 4
            if wrong < len(drafts):
                drafts[wrong] = drafts[wrong] % 40000 + 1  # (never 0: a real token, just not the model's)
            calls.append(wrong)
            out[rid] = drafts
        return out

    monkeypatch.setattr(NgramProposer, "_drafts", oracle)
    st = _check(d, want, {"method": "ngram", "num_speculative_tokens": 3}, torch_ops=True)
    assert st.spec_num_accepted_tokens < st.spec_num_draft_tokens  # rejections: states rewound ...
    by_pos = st.spec_accepted_per_pos
    assert len(by_pos) == 3 and by_pos[2] > 0 and by_pos[0] > by_pos[1] > by_pos[2]  # ... after 0 to 3 accepted


def test_a_draft_model_with_chunked_prefill_and_preemption(qwen35):
    """SmolLM2 drafting for a random Qwen 3.5: nearly every draft is rejected, so nearly every verify step
    rewinds; small steps and a small KV pool add chunked prompts and preemptions (recomputed from the start). (The
    other families' rewinds: the oracle test above.)"""
    d, want = qwen35
    st = _check(d, want, {"method": "draft_model", "model": "default", "num_speculative_tokens": 3},
                max_num_batched_tokens=32, num_gpu_blocks_override=14, max_model_len=128)
    assert st.spec_num_drafts > 20 and st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert st.num_preemptions > 0
