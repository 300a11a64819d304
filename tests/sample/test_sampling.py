"""Sampling parameters end to end through the engine, and input validation."""

import math

import pytest

from conftest import PROMPTS
from pagedllm import SamplingParams


SHORT_CHAT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"  # answered in a few tokens + EOS


def gen(llm, prompts, sp):
    return llm.generate(prompts, sp, use_tqdm=False)


def test_seeded_sampling_alone_equals_busy_batch(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=32)
    alone = gen(llm, PROMPTS[2], sp)[0].outputs[0]
    others = [SamplingParams(temperature=1.0, max_tokens=40)] * 5 + [SamplingParams(temperature=0, max_tokens=20)]
    batch = gen(llm, PROMPTS[:6] + [PROMPTS[2]], others + [sp])
    assert batch[-1].outputs[0].token_ids == alone.token_ids
    again = gen(llm, PROMPTS[2], sp)[0].outputs[0]
    assert again.token_ids == alone.token_ids
    other_seed = gen(llm, PROMPTS[2], SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=32))[0]
    assert other_seed.outputs[0].token_ids != alone.token_ids


def test_top_k_1_equals_greedy(llm):
    greedy = gen(llm, PROMPTS[:4], SamplingParams(temperature=0, max_tokens=24))
    topk1 = gen(llm, PROMPTS[:4], SamplingParams(temperature=1.3, top_k=1, max_tokens=24))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_stop_string_excluded_from_text(llm):
    base = gen(llm, PROMPTS[7], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert "3." in base.text
    out = gen(llm, PROMPTS[7], SamplingParams(temperature=0, max_tokens=40, stop=["3."]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "3."
    assert out.text == base.text[: base.text.index("3.")]
    incl = gen(llm, PROMPTS[7], SamplingParams(temperature=0, max_tokens=40, stop="3.",
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert incl.text == base.text[: base.text.index("3.") + 2]


def test_stop_token_ids_and_ignore_eos(llm):
    base = gen(llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    stop_tok = base.token_ids[3]
    out = gen(llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_tok) + 1]
    # the stop token's text is not in the output (vLLM's rule), unless include_stop_str_in_output asks for it, and
    # neither is eos's where special tokens are kept
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(out.token_ids[:-1])
    incl = gen(llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok],
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert incl.text == tok.decode(incl.token_ids)
    # a chat prompt ends with EOS quickly; ignore_eos keeps going to max_tokens
    eos = llm.engine.eos_token_id
    chat = gen(llm, SHORT_CHAT, SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == eos
    kept = gen(llm, SHORT_CHAT, SamplingParams(temperature=0, max_tokens=200, skip_special_tokens=False))[0].outputs[0]
    assert kept.token_ids == chat.token_ids and kept.text == chat.text  # eos's text is not appended
    forced = gen(llm, SHORT_CHAT, SamplingParams(temperature=0, max_tokens=len(chat.token_ids) + 5,
                                                 ignore_eos=True))[0].outputs[0]
    assert forced.finish_reason == "length" and len(forced.token_ids) == len(chat.token_ids) + 5


def test_min_tokens_blocks_eos(llm):
    chat = gen(llm, SHORT_CHAT, SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    n = len(chat.token_ids)
    assert chat.finish_reason == "stop"
    # max_tokens = min_tokens: an EOS not blocked would end it at n tokens; past n + 3 nothing is checked (before,
    # it ran on to 200 tokens, ~9 s on 2 cores)
    out = gen(llm, SHORT_CHAT, SamplingParams(temperature=0, max_tokens=n + 3, min_tokens=n + 3))[0].outputs[0]
    assert len(out.token_ids) >= n + 3
    assert llm.engine.eos_token_id not in out.token_ids[: n + 2]


def test_logit_bias_forces_token(llm):
    tok_id = llm.engine.tokenizer.encode(" banana")[0]
    out = gen(llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, logit_bias={tok_id: 100.0}))[0]
    assert out.outputs[0].token_ids == [tok_id] * 5


def test_repetition_penalty_changes_greedy_output(llm):
    base = gen(llm, PROMPTS[7], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].token_ids
    pen = gen(llm, PROMPTS[7], SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.8))[0]
    ids = pen.outputs[0].token_ids
    assert ids != base
    assert len(set(ids)) / len(ids) > len(set(base)) / len(base)


def test_n_samples_share_prompt_blocks(llm):
    prompt = PROMPTS[6] * 3  # > 2 full blocks
    out = gen(llm, prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16))[0]
    assert len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    bs = llm.engine.config.cache.block_size
    assert out.num_cached_tokens >= ((len(out.prompt_token_ids) - 1) // bs) * bs > 0


def test_logprobs_match_reference(llm, hf_greedy):
    out = gen(llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, logprobs=3))[0].outputs[0]
    ref_ids, ref_lp = hf_greedy(PROMPTS[0], 12, out.token_ids)
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i] == ref_ids[i]
        assert math.isclose(lp.logprob, ref_lp[i][lp.token_id].item(), abs_tol=2e-3)
        assert lp.rank == 1 and len(lp.top) == 3
        ref_top = ref_lp[i].topk(3)
        assert [t.token_id for t in lp.top] == ref_top.indices.tolist()
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
        assert lp.decoded_token == llm.engine.tokenizer.decode([lp.token_id])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n must be"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 100}, "logprobs"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_requests_raise_and_engine_keeps_serving(llm):
    maxlen = llm.engine.max_model_len
    with pytest.raises(ValueError, match="prompt is empty"):
        gen(llm, "", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=f"maximum context length is {maxlen}"):
        gen(llm, [5] * (maxlen - 3), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="maximum context length"):
        gen(llm, [5] * (maxlen + 1), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="out of range"):
        gen(llm, [1, 2, 10**7], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="logit_bias token id must be < vocab size"):
        gen(llm, "hi", SamplingParams(max_tokens=4, logit_bias={10**7: 1.0}))
    # one bad prompt in a list: nothing is queued, the engine is clean and keeps serving
    with pytest.raises(ValueError):
        gen(llm, [PROMPTS[0], ""], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    llm.engine.core.kv_cache_manager.check_integrity()
    out = gen(llm, PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>system\n")
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in out.outputs[0].text
