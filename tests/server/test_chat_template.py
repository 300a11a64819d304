"""Chat templates take extra variables (vLLM's ``chat_template_kwargs``: Qwen 3's ``enable_thinking``, ...), offline
and through the server; reserved names are refused."""

import pytest

from pagedllm import SamplingParams

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")


@pytest.fixture
def templated(llm):
    tok = llm.get_tokenizer()
    saved, tok.chat_template = tok.chat_template, TEMPLATE
    try:
        yield llm
    finally:
        tok.chat_template = saved


def test_template_variables_reach_the_template(templated):
    msgs = [{"role": "user", "content": "Hi"}]
    eng = templated.engine
    plain = eng.apply_chat_template(msgs)
    off = eng.apply_chat_template(msgs, template_kwargs={"enable_thinking": False})
    assert plain == "<|user|>Hi\n<|assistant|>" and off == plain + "<think>\n\n</think>\n\n"
    sp = SamplingParams(temperature=0, max_tokens=1)
    out = templated.chat(msgs, sp, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    assert out.prompt_token_ids == eng.encode_text(off, add_special_tokens=False)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        eng.apply_chat_template(msgs, template_kwargs={"add_generation_prompt": False})
