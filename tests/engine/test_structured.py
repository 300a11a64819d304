"""Structured outputs (llguidance): JSON schemas, regexes, choices and grammars constrain decoding; OpenAI's
response_format, vLLM's guided_* / structured_outputs and tool calling over the server."""

import json
import os
import re

import httpx
import jsonschema
import pytest

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.server.tools import extract_tool_calls, plan_tools, visible_content

S = {"type": "string", "maxLength": 16}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}}, "required": ["tags"],
     "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
     "required": ["city", "zip"], "additionalProperties": False},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "integer", "minimum": -1000, "maximum": 1000},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": S}, "required": ["a"],
     "additionalProperties": False},  # b optional
    {"$defs": {"item": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
                        "required": ["id"], "additionalProperties": False}},
     "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0,
                                                                             "maximum": 1000}},
     "required": ["status", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                      {"type": "null"}]}},
     "required": ["v"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": S, "langs": {"type": "array", "items": {"enum": ["py", "rs", "go"]}, "maxItems": 3}},
        "required": ["name", "langs"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "boolean"},
    {"type": "array", "items": {"type": "object", "properties": {"k": S, "v": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99}},
                                "required": ["k", "v"], "additionalProperties": False}, "maxItems": 2},
    {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 500},
                                      "currency": {"enum": ["USD", "EUR"]}},
     "required": ["price", "currency"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"title": S, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "notes": {"type": "array", "items": S, "maxItems": 2}},
     "required": ["title", "rating"], "additionalProperties": False},
]
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(cat|dog|bird)s?", r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}", r"0x[0-9a-f]{4}",
           r"(yes|no)\."]
CHOICES = [["Paris", "London", "Rome"], ["positive", "negative", "neutral"]]
PROMPT = "<|im_start|>user\nAnswer in the requested format: describe a person, a city or a number.<|im_end|>\n" \
         "<|im_start|>assistant\n"


def test_params_and_protocol_mapping():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{bad")
    with pytest.raises(ValueError, match="unsupported structured outputs field"):
        SamplingParams(structured_outputs={"xml": "<a/>"})
    sp = SamplingParams(guided_decoding={"choice": ["a", "b"]})
    assert sp.structured_outputs == StructuredOutputsParams(choice=["a", "b"]) and sp.guided_decoding is None
    r = CompletionRequest(prompt="x", guided_regex="[0-9]+")
    assert r.structured() == StructuredOutputsParams(regex="[0-9]+")
    r = CompletionRequest(prompt="x", structured_outputs={"json": {"type": "object"}})
    assert r.structured().key() == ("json_schema", '{"type": "object"}')
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=msgs, response_format={"type": "json_object"}).structured().json_object
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[0], "strict": True}}
    assert ChatCompletionRequest(messages=msgs, response_format=rf).structured().json == SCHEMAS[0]
    assert ChatCompletionRequest(messages=msgs, response_format={"type": "text"}).structured() is None
    with pytest.raises(ValueError, match="one structured output constraint"):
        ChatCompletionRequest(messages=msgs, response_format={"type": "json_object"}, guided_regex="a").structured()
    r = ChatCompletionRequest(messages=msgs, user="u", metadata={"a": 1}, audio={"voice": "x"}, foo=1)
    assert r.unsupported_fields() == ["audio", "foo"]  # hints (metadata) pass, the rest is refused


def test_tool_plans_and_parsing():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "add", "parameters": {
                 "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    funcs = {"get_weather": tools[0]["function"]["parameters"], "add": tools[1]["function"]["parameters"]}
    named = plan_tools(tools, {"type": "function", "function": {"name": "add"}}, True, False)
    assert named.mode == "named" and named.structured.json == funcs["add"] and named.funcs == funcs
    content, calls = extract_tool_calls(named, '{"a": 1, "b": 2}')
    assert content is None and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    req = plan_tools(tools, "required", False, False)
    assert req.structured.json["maxItems"] == 1
    _, calls = extract_tool_calls(req, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"} and calls[0]["id"].startswith("call_")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        plan_tools(tools, "auto", True, False)
    with pytest.raises(ValueError, match="not in tools"):
        plan_tools(tools, {"type": "function", "function": {"name": "nope"}}, True, False)
    with pytest.raises(ValueError, match="duplicate"):
        plan_tools(tools + tools[:1], "none", True, False)
    auto = plan_tools(tools, "auto", True, True)
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    content, calls = extract_tool_calls(auto, text)
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_weather"
    assert visible_content(auto, text) == "Let me check.\n" and visible_content(auto, "Hi <tool") == "Hi "
    assert extract_tool_calls(auto, "no calls here") == ("no calls here", [])
    # gpt-oss's harmony tool messages (--tool-call-parser openai), as --reasoning-parser openai_gptoss leaves them in
    # the content: each call's arguments as the model wrote them, an unknown function left as content
    from pagedllm.server.reasoning import make_reasoning_parser

    harmony = ('<|channel|>analysis<|message|>Need Rome and a sum.<|end|><|start|>assistant<|channel|>commentary '
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>'
               '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}<|call|>')
    reasoning, content = make_reasoning_parser("openai_gptoss").split(harmony)
    assert reasoning == "Need Rome and a sum."
    oai = plan_tools(tools, "auto", True, True, "openai")
    text, calls = extract_tool_calls(oai, content)
    assert text is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("add", {"a": 1, "b": 2})]
    assert visible_content(oai, "Sure.<|chan") == "Sure." and visible_content(oai, content) == ""
    unknown = "<|channel|>commentary to=functions.nope<|message|>{}"
    assert extract_tool_calls(oai, unknown) == (unknown, [])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_constrained_output_is_valid(llm_nocache, temperature):
    """25+ JSON schemas, regexes and choices in one batch (greedy and sampled): each output parses and validates,
    matches its regex in full, or is one of its choices; each ends by EOS, not by running out of tokens."""
    cons = [StructuredOutputsParams(json=s) for s in SCHEMAS]
    cons += [StructuredOutputsParams(regex=r) for r in REGEXES]
    cons += [StructuredOutputsParams(choice=c) for c in CHOICES]
    cons += [StructuredOutputsParams(grammar='start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/')]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=160, structured_outputs=c)
              for i, c in enumerate(cons)]
    prompts = [PROMPT] * len(cons)
    cons.append(StructuredOutputsParams(json_object=True))  # any object: a prompt that asks for a small one
    # seeded like the others: unseeded, a sampled object sometimes nested on past its token limit (a flaky test)
    params.append(SamplingParams(temperature=temperature, seed=len(cons), max_tokens=120,
                                 structured_outputs=cons[-1]))
    prompts.append('<|im_start|>user\nReply with the JSON object {"ok": true} and nothing else.<|im_end|>\n'
                   '<|im_start|>assistant\n')
    outs = llm_nocache.generate(prompts, params, use_tqdm=False)
    for c, o in zip(cons, outs):
        text, reason = o.outputs[0].text, o.outputs[0].finish_reason
        assert reason == "stop", (c, text)
        if c.json is not None:
            jsonschema.validate(json.loads(text), c.json)
        elif c.json_object:
            assert isinstance(json.loads(text), dict)
        elif c.regex is not None:
            assert re.fullmatch(c.regex, text), (c.regex, text)
        elif c.choice is not None:
            assert text in c.choice
        else:
            assert re.fullmatch(r"The answer is [0-9]{1,3}\.", text), text


def test_constrained_request_beside_free_ones_and_after_preemption(llm_nocache):
    """A constrained request batched with unconstrained ones leaves their tokens alone; under preemption
    (recompute) its grammar stays in step with its tokens."""
    from conftest import PROMPTS
    from pagedllm import LLM

    free = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm_nocache.generate(PROMPTS[:3], free, use_tqdm=False)]
    cons = SamplingParams(temperature=0, max_tokens=120, structured_outputs={"json": SCHEMAS[0]})
    mixed = llm_nocache.generate(PROMPTS[:3] + [PROMPT], [free] * 3 + [cons], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    ref = mixed[3].outputs[0].text
    jsonschema.validate(json.loads(ref), SCHEMAS[0])
    tight = LLM(dtype="float32", num_gpu_blocks_override=16, max_model_len=256, max_num_seqs=8)
    outs = tight.generate([PROMPT] * 8, cons, use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0, "the pool was large enough: no preemption happened"
    for o in outs:
        assert o.outputs[0].text == ref  # greedy: identical to the request run alone


@pytest.fixture(scope="module")
def spec_llm():
    from pagedllm import LLM

    return LLM(dtype="float32", enable_prefix_caching=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})


def test_constrained_with_speculation_and_n(llm_nocache, spec_llm):
    """n-gram speculation: drafts are cut to what the grammar accepts and each verified row is masked by the
    grammar's state after the drafts before it, so greedy output is the non-speculative one; n > 1 samples each
    follow the constraint."""
    cons = [{"json": s} for s in SCHEMAS[:6]] + [{"regex": r} for r in REGEXES[:2]]
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=c) for c in cons]
    ref = [o.outputs[0].text for o in llm_nocache.generate([PROMPT] * len(cons), params, use_tqdm=False)]
    spec = spec_llm
    got = spec.generate([PROMPT] * len(cons), params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == ref
    assert spec.engine.stats().spec_num_draft_tokens > 0  # drafts were proposed and verified
    many = llm_nocache.generate(PROMPT, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=120,
                                                 structured_outputs={"json": SCHEMAS[0]}), use_tqdm=False)[0]
    assert len(many.outputs) == 4
    for c in many.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMAS[0])


def test_constraint_after_its_text(llm_nocache, spec_llm):
    """A constraint with ``after`` (what a reasoning parser sets to ``</think>``) leaves the output free until that
    text has appeared in it, then constrains the rest: the free part is the unconstrained greedy output token for
    token, the rest matches the constraint; the same with n-gram speculation, batched with other requests, and
    where the text never comes (the whole output is the free one)."""
    free = llm_nocache.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    ids = list(free.token_ids)
    k = 6  # the free part: the first k tokens; their text is the ``after`` text (it first completes at token k)
    tag = llm_nocache.get_tokenizer().decode(ids[:k])
    assert tag and free.text.startswith(tag)
    regex = "The answer is 4"
    params = [SamplingParams(temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(
                  regex=regex, after=tag)),
              SamplingParams(temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(
                  json=SCHEMAS[1], after=tag)),
              SamplingParams(temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(
                  regex=regex, after="</think>")),
              SamplingParams(temperature=0, max_tokens=32)]
    for llm in (llm_nocache, spec_llm):
        outs = [o.outputs[0] for o in llm.generate([PROMPT] * 4, params, use_tqdm=False)]
        assert list(outs[0].token_ids[:k]) == ids[:k] and outs[0].text == tag + regex
        assert outs[0].finish_reason == "stop"
        assert list(outs[1].token_ids[:k]) == ids[:k] and outs[1].text.startswith(tag)
        jsonschema.validate(json.loads(outs[1].text[len(tag):]), SCHEMAS[1])
        assert list(outs[2].token_ids) == ids  # "</think>" never comes: the output stays free
        assert list(outs[3].token_ids) == ids


def test_drafts_stop_before_completing_the_after_text(llm_nocache):
    """While a grammar waits for its ``after`` text, a request's drafts end before the draft that would complete it
    (the row after that one must be masked); once the text is there, drafts are cut to what the grammar accepts."""
    from pagedllm.sample.metadata import CachedRequestState
    from pagedllm.sample.structured import constrain_drafts, sync_matcher

    structured = llm_nocache.engine.structured
    enc = llm_nocache.get_tokenizer().encode
    think, answer = enc("I think so.</think>", add_special_tokens=False), enc('{"ok": true}', add_special_tokens=False)
    so = StructuredOutputsParams(json=SCHEMAS[1], after="</think>")
    st = CachedRequestState("r", [1, 2], SamplingParams(structured_outputs=so), None, output_token_ids=think[:2])
    assert sync_matcher(st, structured) is None and st.grammar_from is None  # still free
    drafts = think[2:] + answer
    constrain_drafts(st, drafts, structured)
    assert drafts == think[2:-1]  # up to, not including, the draft that completes </think>
    st.output_token_ids = list(think)  # the model wrote it
    assert sync_matcher(st, structured) is not None and st.grammar_from == len(think)
    drafts = answer + enc(" trailing", add_special_tokens=False)
    constrain_drafts(st, drafts, structured)
    assert drafts == answer  # the grammar takes the JSON, not what follows it
    st.output_token_ids = think[:3]  # dropped back before </think> (rejected drafts): free again
    assert sync_matcher(st, structured) is None and st.matcher is None


def test_bad_grammar_is_a_value_error(llm_nocache):
    for bad, msg in (({"regex": "[0-9"}, "invalid regex"), ({"json": {"type": "foo"}}, "invalid JSON schema"),
                     ({"grammar": "start: ("}, "invalid grammar")):
        with pytest.raises(ValueError, match=msg):
            llm_nocache.generate(PROMPT, SamplingParams(max_tokens=4, structured_outputs=bad), use_tqdm=False)


# ---------------------------------------------------------------------- over HTTP
MODEL = "SmolLM2-135M-Instruct"  # the server's default name for the embedded model
TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "..", "pagedllm", "server", "templates",
                        "hermes_tools_chatml.jinja")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    from helpers import start_server

    proc, base, log = start_server(tmp_path_factory, "--chat-template", TEMPLATE, "--enable-auto-tool-choice",
                                   "--tool-call-parser", "hermes")
    yield base
    proc.terminate()
    proc.wait(timeout=30)


def test_openai_parse_and_stream(tool_server):
    import openai
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    client = openai.OpenAI(base_url=tool_server + "/v1", api_key="unused")
    msgs = [{"role": "user", "content": "Invent a person: name and age."}]
    r = client.chat.completions.parse(model=MODEL, messages=msgs, response_format=Person, max_tokens=60,
                                      temperature=0)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
    with client.beta.chat.completions.stream(model=MODEL, messages=msgs, response_format=Person, max_tokens=60,
                                             temperature=0) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == person  # streamed = non-streamed (greedy)
    r = client.completions.create(model=MODEL, prompt="The year is", max_tokens=8, temperature=0,
                                  extra_body={"guided_regex": "20[0-9]{2}"})
    assert re.fullmatch("20[0-9]{2}", r.choices[0].text)
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=8,
                                  extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.choices[0].text in ("left", "right")


def test_bad_constraints_and_unknown_fields_are_400(tool_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for extra, param in (({"guided_regex": "[0-9"}, None), ({"response_format": {"type": "xml"}}, None),
                         ({"audio": {"voice": "x"}}, "audio"), ({"functions": []}, "functions"),
                         ({"tool_choice": "auto"}, None)):
        r = httpx.post(tool_server + "/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        if param:
            assert err["param"] == param and param in err["message"]
    ok = httpx.post(tool_server + "/v1/chat/completions", json={**body, "metadata": {"k": "v"}}, timeout=60)
    assert ok.status_code == 200  # a documented hint is accepted


def test_tool_call_round_trip(tool_server):
    """named, required and auto tool choice; the call goes back as an assistant message with tool_calls and a
    tool message, and the model answers with text."""
    import openai

    client = openai.OpenAI(base_url=tool_server + "/v1", api_key="unused")
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        call = c.message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=60, temperature=0, stream=True)
    deltas = [ch.choices[0] for ch in stream if ch.choices]
    streamed = [tc for d in deltas if d.delta.tool_calls for tc in d.delta.tool_calls]
    assert deltas[-1].finish_reason == "tool_calls" and streamed[0].function.name == "get_weather"
    assert streamed[0].function.arguments == call.function.arguments
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18, "sky": "clear"}'}]
    r = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER], tool_choice="none",
                                       max_tokens=40, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="auto",
                                       max_tokens=80, temperature=0)
    c = r.choices[0]
    if c.message.tool_calls:  # the model chose to call: it must be a well-formed call to a known function
        assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather"
        json.loads(c.message.tool_calls[0].function.arguments)
    else:
        assert c.message.content and "<tool_call>" not in c.message.content
