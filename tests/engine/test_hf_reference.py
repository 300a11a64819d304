"""Greedy output equals HuggingFace transformers (same GGUF weights) token for token: alone, batched, staggered."""

import pytest

from conftest import ALONE_MAX_TOKENS, PROMPTS
from helpers import assert_greedy_close
from pagedllm import SamplingParams

N_NEW = ALONE_MAX_TOKENS  # the shared alone outputs' length (conftest's greedy_alone)
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, logprobs=5)


def _check(outputs, hf_greedy, label):
    exact = 0
    for prompt, out in zip(PROMPTS, outputs):
        c = out.outputs[0]
        ref_ids, ref_lp = hf_greedy(prompt, N_NEW, c.token_ids)
        top = [[t.token_id for t in lp.top] for lp in c.logprobs]
        m = assert_greedy_close(c.token_ids, top, ref_ids, ref_lp, f"{label}: {prompt[:30]!r}")
        exact += m == len(ref_ids)
    print(f"{label}: {exact}/{len(PROMPTS)} prompts match the reference exactly")
    # Near-ties are rare in float32: most prompts must match to the last token.
    assert exact >= len(PROMPTS) - 1, f"{label}: only {exact}/{len(PROMPTS)} prompts matched exactly"


@pytest.fixture(scope="module")
def batch(llm):
    """All prompts in one batch (shared by the batch and the text checks: one batched run)."""
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_each_prompt_alone(greedy_alone, hf_greedy):
    """Each prompt alone (conftest's ``greedy_alone``, the same engine and settings as ``GREEDY``)."""
    _check([greedy_alone[p] for p in PROMPTS], hf_greedy, "alone")


def test_all_prompts_in_one_batch(batch, hf_greedy):
    _check(batch, hf_greedy, "batch")


def test_staggered_arrivals(llm, hf_greedy):
    """New requests join while others are mid-decode: prefills and decodes share steps."""
    eng = llm.engine
    results = {}
    pending = list(enumerate(PROMPTS))
    steps = 0
    mixed_steps = 0
    sched = eng.core.scheduler
    while pending or eng.has_unfinished_requests():
        if pending and steps % 3 == 0:
            i, p = pending.pop(0)
            eng.add_request(f"stagger-{i}", p, GREEDY)
        so = sched.schedule()
        lens = [len(s.token_ids) for s in so.scheduled]
        mixed_steps += 1 in lens and any(n > 1 for n in lens)
        result = eng.core.runner.execute(so)
        outs, _, _ = eng.output_processor.process(sched.update_from_output(so, result))
        results.update({o.request_id: o for o in outs if o.finished})
        steps += 1
    assert mixed_steps >= len(PROMPTS) // 2, f"only {mixed_steps} steps mixed a prefill with running decodes"
    _check([results[f"stagger-{i}"] for i in range(len(PROMPTS))], hf_greedy, "staggered")


def test_text_matches_reference_tokenizer(batch, hf_model):
    tok, _ = hf_model
    for o in batch[:4]:
        c = o.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert o.prompt_token_ids == tok(o.prompt).input_ids
