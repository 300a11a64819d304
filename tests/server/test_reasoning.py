"""`--reasoning-parser` (deepseek_r1, qwen3; openai_gptoss: gpt-oss's harmony channels): the parsers on whole texts and on deltas split at every position (tags
cut in two included), then a live server where a regex constraint forces the model's output to hold `</think>`
(`--structured-outputs-in-reasoning`: the constraint covers the reasoning too): `reasoning_content` / `content` on
the chat endpoint (official `openai` SDK, plain and streamed) and a `thinking` block on Anthropic's /v1/messages
(plain and streamed); then a server with the default, where a constraint applies only to the answer after the
reasoning."""

import json

import anthropic
import httpx
import openai
import pytest

from pagedllm.server.reasoning import REASONING_PARSERS, ReasoningParser, make_reasoning_parser
from helpers import MODEL, start_server

# (text, deepseek_r1's (reasoning, content), qwen3's) of a finished output
CASES = [
    ("I think.</think>The answer is 4", ("I think.", "The answer is 4"), ("I think.", "The answer is 4")),
    ("<think>I think.</think>The answer is 4", ("I think.", "The answer is 4"), ("I think.", "The answer is 4")),
    ("<think>\nhmm\n</think>\n\nYes.", ("\nhmm\n", "\n\nYes."), ("\nhmm\n", "\n\nYes.")),
    ("no tags at all", ("no tags at all", None), (None, "no tags at all")),
    ("just thinking </thi", ("just thinking </thi", None), (None, "just thinking </thi")),
    ("</think>only content", (None, "only content"), (None, "only content")),
    ("a < b <think and </thinking> </think>x</think>y", ("a < b <think and </thinking> ", "x</think>y"),
     ("a < b <think and </thinking> ", "x</think>y")),
    ("", (None, None), (None, None)),
]


THINK_PARSERS = [n for n in REASONING_PARSERS if n != "openai_gptoss"]


@pytest.mark.parametrize("name", THINK_PARSERS)
@pytest.mark.parametrize("text,ds,qw", CASES)
def test_split_whole_text(name, text, ds, qw):
    assert ReasoningParser(name).split(text) == (ds if name == "deepseek_r1" else qw)


def run_feed(name: str, pieces: list[str]) -> tuple[str, str]:
    p = make_reasoning_parser(name)
    reasoning = content = ""
    for piece in pieces:
        r, c = p.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = p.finish()
    assert p.finish() == ("", "")  # once
    return reasoning + r, content + c


def streamed(name: str, text: str) -> tuple[str, str]:
    """What streaming gives for a whole output: qwen3 streams an output that does not start with <think> as content
    (it cannot know yet), dropping a stray </think>; otherwise the same as split."""
    r, c = ReasoningParser(name).split(text)
    if name == "qwen3" and not text.startswith("<think>"):
        return "", text.replace("</think>", "", 1)
    if name == "qwen3" and "</think>" not in text:
        return text.removeprefix("<think>"), ""
    return r or "", c or ""


# gpt-oss's harmony output (the prompt ends with <|start|>assistant): (text, (reasoning, content))
HARMONY = [
    ("<|channel|>analysis<|message|>User asks 2+2.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
     ("User asks 2+2.", "It is 4.")),
    ("<|channel|>analysis<|message|>a < b, <|x|> stays<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>",
     ("a < b, <|x|> stays", "4")),
    ("<|channel|>analysis<|message|>need the weather<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
     ("need the weather", "<|channel|>commentary to=functions.get_weather<|message|>{\"city\": \"Paris\"}")),
    ("<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
     (None, "Looking it up.Done.")),
    ("<|channel|>analysis<|message|>unfinished thou", ("unfinished thou", None)),
    ("<|channel|>final<|message|>just the answer", (None, "just the answer")),
    ("plain text, no header <b>", (None, "plain text, no header <b>")),
    ("<b>not a tag</b>", (None, "<b>not a tag</b>")),
    ("<|channel|>analy", (None, None)),
    ("", (None, None)),
]


@pytest.mark.parametrize("text,want", HARMONY)
def test_harmony_channels(text, want):
    assert make_reasoning_parser("openai_gptoss").split(text) == want
    got = (want[0] or "", want[1] or "")
    assert run_feed("openai_gptoss", [text]) == got
    for i in range(len(text) + 1):  # two deltas: every cut, tags cut in two included
        assert run_feed("openai_gptoss", [text[:i], text[i:]]) == got, i
    assert run_feed("openai_gptoss", list(text)) == got  # one character at a time


@pytest.mark.parametrize("name", THINK_PARSERS)
@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_feed_split_at_every_position(name, text):
    want = streamed(name, text)
    assert run_feed(name, [text]) == want
    for i in range(len(text) + 1):  # two deltas: every cut, tags cut in two included
        assert run_feed(name, [text[:i], text[i:]]) == want, i
    for i in range(len(text) + 1):  # three deltas
        for j in range(i, len(text) + 1):
            assert run_feed(name, [text[:i], text[i:j], text[j:]]) == want, (i, j)
    assert run_feed(name, list(text)) == want  # one character at a time


def test_feed_holds_back_only_tag_prefixes():
    p = ReasoningParser("deepseek_r1")
    assert p.feed("I think</th") == ("I think", "")  # "</th" may become </think>
    assert p.feed("is is not it") == ("</this is not it", "")
    assert p.feed(" </think") == (" ", "")
    assert p.feed(">Four") == ("", "Four")
    assert p.feed(" </think> stays") == ("", " </think> stays")  # after the reasoning: plain content
    assert p.finish() == ("", "")
    q = ReasoningParser("qwen3")
    assert q.feed("<thi") == ("", "")  # may be the opening tag
    assert q.feed("nk>why") == ("why", "")
    q = ReasoningParser("qwen3")
    assert q.feed("<thx") == ("", "<thx")  # not the opening tag: content


def test_advance_takes_the_text_so_far():
    p = ReasoningParser("deepseek_r1")
    assert p.advance("I th", False) == ("I th", "")
    assert p.advance("I think.</th", False) == ("ink.", "")
    assert p.advance("I think.</think>The", False) == ("", "The")
    assert p.advance("I think.</think>The answer", True) == ("", "The answer")


def test_unknown_parser():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("nope")


# ---------------------------------------------------------------------- live server
FORCED = r"I think\.</think>The answer is 4"  # the regex that forces the model's output
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    proc, url, _ = start_server(tmp_path_factory, "--reasoning-parser", "deepseek_r1",
                                "--structured-outputs-in-reasoning")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


def test_chat_completion_reasoning_content(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                       extra_body={"guided_regex": FORCED})
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "I think." and m.model_extra["reasoning"] == "I think."
    assert m.content == "The answer is 4"
    assert r.choices[0].finish_reason == "stop"


def test_chat_completion_streamed_reasoning_content(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0, stream=True,
                                            extra_body={"guided_regex": FORCED})
    reasoning = content = ""
    order = []
    for chunk in stream:
        for ch in chunk.choices:
            r = (ch.delta.model_extra or {}).get("reasoning_content")
            if r:
                reasoning += r
                order.append("r")
            if ch.delta.content:
                content += ch.delta.content
                order.append("c")
    assert reasoning == "I think." and content == "The answer is 4"
    assert order.index("c") > max(i for i, x in enumerate(order) if x == "r")  # reasoning first, then content
    assert len(order) > 2  # it streamed in pieces, not one chunk


def test_no_end_tag_is_all_reasoning(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                       extra_body={"guided_regex": "Hmm, four"})
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "Hmm, four" and m.content is None


def test_anthropic_thinking_block(base):
    # Anthropic's request has no regex field: its JSON schema output format forces the (JSON string) output
    schema = {"type": "string", "enum": ["I think.</think>The answer is 4"]}
    c = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    body = dict(model=MODEL, max_tokens=40, messages=ASK, extra_body={"temperature": 0,
                                                                       "output_config": {"format": {
                                                                           "type": "json_schema", "schema": schema}}})
    r = c.messages.create(**body)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == '"I think.' and r.content[0].signature == ""
    assert r.content[1].text == 'The answer is 4"'
    # streamed: a thinking block (thinking_delta events), then the text block
    with httpx.stream("POST", base + "/v1/messages", json={"model": MODEL, "max_tokens": 40, "messages": ASK,
                                                           "stream": True, **body["extra_body"]}, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [e["content_block"]["type"] for e in starts] == ["thinking", "text"]
    assert [e["index"] for e in starts] == [0, 1]
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    thinking = "".join(e["delta"]["thinking"] for e in deltas if e["delta"]["type"] == "thinking_delta")
    text = "".join(e["delta"]["text"] for e in deltas if e["delta"]["type"] == "text_delta")
    assert thinking == '"I think.' and text == 'The answer is 4"'
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]
    # the SDK's stream accumulates the same message
    with c.messages.stream(**body) as st:
        final = st.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", '"I think.'), ("text", 'The answer is 4"')]


def test_responses_reasoning_item(client):
    """/v1/responses: the reasoning is a `reasoning` output item before the message, plain and streamed (the
    SDK's `responses.stream` accumulates the same response)."""
    fmt = {"format": {"type": "json_schema", "name": "answer",
                      "schema": {"type": "string", "enum": ["I think.</think>The answer is 4"]}}}
    r = client.responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=40, temperature=0, text=fmt)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == '"I think.'
    assert r.output_text == 'The answer is 4"' and r.status == "completed"
    with client.responses.stream(model=MODEL, input="What is 2 + 2?", max_output_tokens=40, temperature=0,
                                 text=fmt) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == '"I think.' and final.output_text == 'The answer is 4"'
    assert kinds.index("response.output_text.delta") > kinds.index("response.reasoning_text.done")
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


# ---------------------------------------------------------------------- the default: constraints after the reasoning
# ChatML that, like Qwen 3's template, closes an empty reasoning block itself when enable_thinking is false
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def answer_client(tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    proc, url, _ = start_server(tmp_path_factory, "--reasoning-parser", "deepseek_r1", "--chat-template",
                                str(template))
    yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    proc.terminate()
    proc.wait(timeout=30)


def test_constraint_waits_for_the_end_of_the_reasoning(answer_client):
    """The model never closes its reasoning here: the output stays free (the unconstrained greedy text, all of it
    reasoning), through the chat endpoint and the Responses API alike; the constraint would apply after </think>."""
    c = answer_client
    free = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0).choices[0].message
    assert free.content is None and free.model_extra["reasoning_content"]
    r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0,
                                  extra_body={"guided_regex": "The answer is 4"})
    assert r.choices[0].message.model_extra["reasoning_content"] == free.model_extra["reasoning_content"]
    assert r.choices[0].message.content is None
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "integer"}}}
    resp = c.responses.create(model=MODEL, input=ASK, max_output_tokens=24, temperature=0, text=fmt)
    assert [o.type for o in resp.output] == ["reasoning"]
    assert resp.output[0].content[0].text == free.model_extra["reasoning_content"]


def test_constraint_applies_from_the_start_when_the_prompt_closed_the_reasoning(answer_client):
    """enable_thinking false: the template closes the reasoning, so the constraint applies from the first token and
    the whole output is content (plain, streamed, and a named tool call)."""
    c = answer_client
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0,
                                  extra_body={"guided_regex": "The answer is 4", **off})
    m = r.choices[0].message
    assert m.content == "The answer is 4" and m.model_extra.get("reasoning_content") is None
    stream = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0, stream=True,
                                       extra_body={"guided_regex": "The answer is 4", **off})
    deltas = [ch.delta for chunk in stream for ch in chunk.choices]
    assert "".join(d.content or "" for d in deltas) == "The answer is 4"
    assert not any((d.model_extra or {}).get("reasoning_content") for d in deltas)
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}
    r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0, tools=[tool],
                                  tool_choice={"type": "function", "function": {"name": "add"}}, extra_body=off)
    assert r.choices[0].message.tool_calls, r.choices[0].message
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and isinstance(json.loads(call.function.arguments)["a"], int)


def test_harmony_channels_through_the_chat_endpoint(tmp_path_factory):
    """`--reasoning-parser openai_gptoss`: a harmony output (forced by a regex; the embedded model's vocabulary
    spells the tags as plain text, gpt-oss's as special tokens, which the parser asks the detokenizer to keep)
    comes back as reasoning_content (analysis) and content (final), whole and streamed; with `--tool-call-parser
    openai`, a tool message comes back as a tool call."""
    forced = (r"<\|channel\|>analysis<\|message\|>I think\.<\|end\|><\|start\|>assistant<\|channel\|>final"
              r"<\|message\|>The answer is 4")
    proc, url, _ = start_server(tmp_path_factory, "--reasoning-parser", "openai_gptoss",
                                "--structured-outputs-in-reasoning", "--enable-auto-tool-choice",
                                "--tool-call-parser", "openai")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        kw = dict(model=MODEL, messages=ASK, max_tokens=60, temperature=0, extra_body={"guided_regex": forced})
        m = c.chat.completions.create(**kw).choices[0].message
        assert m.model_extra["reasoning_content"] == "I think." and m.content == "The answer is 4"
        reasoning = content = ""
        for chunk in c.chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
                content += ch.delta.content or ""
        assert (reasoning, content) == ("I think.", "The answer is 4")
        call = (r"<\|channel\|>analysis<\|message\|>Weather\.<\|end\|><\|start\|>assistant<\|channel\|>commentary "
                r'to=functions\.get_weather <\|constrain\|>json<\|message\|>\{"city": "Paris"\}')
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}
        r = c.chat.completions.create(**kw | {"extra_body": {"guided_regex": call}}, tools=[tool])
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"] == "Weather." and m.content is None
        assert [(t.function.name, t.function.arguments) for t in m.tool_calls] == [("get_weather", '{"city": "Paris"}')]
        assert r.choices[0].finish_reason == "tool_calls"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
