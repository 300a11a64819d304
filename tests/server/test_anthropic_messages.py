"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) on the real server, driven by the official
`anthropic` SDK: plain and streamed messages (greedy: the same text), stop sequences, tool use and tool results
(checked against the chat completions endpoint given the same conversation), token counting, Anthropic-shaped
errors and the `x-api-key` header."""

import json
import os
import time

import anthropic
import httpx
import jsonschema
import pytest

from helpers import MODEL, scrape, start_server

KEY = "anthropic-key-1"
TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "..", "pagedllm", "server", "templates",
                        "hermes_tools_chatml.jinja")
GREEDY = {"temperature": 0}  # this SDK has no temperature argument: extra_body carries it
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                            "required": ["city"], "additionalProperties": False}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
COUNT = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    proc, url, _ = start_server(tmp_path_factory, "--api-key", KEY, "--chat-template", TEMPLATE,
                                "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(base):
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)


def chat(base, messages, **kw) -> dict:
    """The same conversation through /v1/chat/completions (greedy)."""
    r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"model": MODEL, "messages": messages, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(base, body) -> list[tuple[str, dict]]:
    with httpx.stream("POST", base + "/v1/messages", json={**body, "stream": True}, headers={"x-api-key": KEY},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        obj = json.loads(data[6:])
        assert obj["type"] == name[7:]
        events.append((name[7:], obj))
    return events


def test_plain_message_content_usage_and_stop_reason(client, base):
    r = client.messages.create(model=MODEL, max_tokens=8, messages=COUNT, extra_body=GREEDY)
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 0
    system = "You are a friendly assistant."
    r = client.messages.create(model=MODEL, max_tokens=120, system=system,
                               messages=[{"role": "user", "content": "Say hi"}], extra_body=GREEDY)
    assert r.stop_reason == "end_turn" and 0 < r.usage.output_tokens < 120
    # the same conversation through the chat endpoint: the same prompt and the same greedy answer
    ref = chat(base, [{"role": "system", "content": system}, {"role": "user", "content": "Say hi"}],
               max_tokens=120)
    assert r.content[0].text == ref["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == ref["usage"]["completion_tokens"]


def test_stream_equals_non_stream(client, base):
    kw = {"model": MODEL, "max_tokens": 24, "extra_body": GREEDY,
          "system": [{"type": "text", "text": "You are terse. "}, {"type": "text", "text": "Answer in English."}],
          "messages": [{"role": "user", "content": [{"type": "text", "text": "Name three colors."}]}]}
    plain = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1  # it streamed, token by token
    assert "".join(pieces) == final.content[0].text == plain.content[0].text
    assert final.stop_reason == plain.stop_reason
    assert (final.usage.input_tokens, final.usage.output_tokens) == (plain.usage.input_tokens,
                                                                     plain.usage.output_tokens)
    # the raw event sequence
    body = {k: v for k, v in kw.items() if k != "extra_body"} | GREEDY
    events = sse_events(base, body)
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == plain.usage.input_tokens
    assert "".join(o["delta"]["text"] for n, o in events if n == "content_block_delta") == plain.content[0].text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": plain.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == plain.usage.output_tokens


def test_stop_sequences(client):
    full = client.messages.create(model=MODEL, max_tokens=40, messages=COUNT, extra_body=GREEDY).content[0].text
    assert "4" in full
    r = client.messages.create(model=MODEL, max_tokens=40, messages=COUNT, stop_sequences=["4"], extra_body=GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "4"
    text = r.content[0].text
    assert "4" not in text and full.startswith(text) and full[len(text)] == "4"
    with client.messages.stream(model=MODEL, max_tokens=40, messages=COUNT, stop_sequences=["4"],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", "4", text)


def test_tool_use_forced_streamed_and_tool_result_turn(client, base):
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}):
        r = client.messages.create(model=MODEL, max_tokens=60, messages=ASK_WEATHER, tools=[WEATHER],
                                   tool_choice=choice, extra_body=GREEDY)
        assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
        call = r.content[0]
        assert call.id.startswith("toolu_") and call.name == "get_weather"
        jsonschema.validate(call.input, WEATHER["input_schema"])
        with client.messages.stream(model=MODEL, max_tokens=60, messages=ASK_WEATHER, tools=[WEATHER],
                                    tool_choice=choice, extra_body=GREEDY) as stream:
            final = stream.get_final_message()  # the SDK assembles the input from input_json_delta events
        assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
        assert (final.content[0].name, final.content[0].input) == (call.name, call.input)
    # the chat endpoint given the same turn in OpenAI's form renders the same prompt and answers the same (one
    # greedy request: both forms of the result below are compared with it)
    ref = chat(base, ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18, "sky": "clear"}'}],
               tools=[{"type": "function", "function": {"name": WEATHER["name"],
                                                        "description": WEATHER["description"],
                                                        "parameters": WEATHER["input_schema"]}}],
               tool_choice="none", max_tokens=40)
    # the call goes back with its result (text-block content, then a plain string) and the model answers in text
    for result in ([{"type": "text", "text": '{"temperature_c": 18, "sky": "clear"}'}],
                   '{"temperature_c": 18, "sky": "clear"}'):
        turn = ASK_WEATHER + [{"role": "assistant", "content": r.content},
                              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                            "content": result}]}]
        ans = client.messages.create(model=MODEL, max_tokens=40, messages=turn, tools=[WEATHER],
                                     tool_choice={"type": "none"}, extra_body=GREEDY)
        assert ans.stop_reason in ("end_turn", "max_tokens") and ans.content[0].type == "text"
        assert ans.content[0].text == ref["choices"][0]["message"]["content"]
        assert ans.usage.input_tokens == ref["usage"]["prompt_tokens"]


def test_count_tokens_equals_usage(client):
    for kw in ({"messages": COUNT},
               {"messages": ASK_WEATHER, "system": "Use the tools.", "tools": [WEATHER],
                "tool_choice": {"type": "tool", "name": "get_weather"}}):
        counted = client.messages.count_tokens(model=MODEL, **kw).input_tokens
        r = client.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, **kw)
        assert counted == r.usage.input_tokens > 0
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],
                                              tool_choice={"type": "any"}).input_tokens
    without = client.messages.count_tokens(model=MODEL, messages=ASK_WEATHER).input_tokens
    assert with_tools > without  # the template renders the tools into the prompt


def test_errors_in_anthropic_shape(client, base):
    with pytest.raises(anthropic.BadRequestError) as e:  # max_tokens missing (the SDK's raw post sends it as is)
        client.post("/v1/messages", body={"model": MODEL, "messages": ASK_WEATHER}, cast_to=anthropic.types.Message)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    bad_key = anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad_key.messages.create(model=MODEL, max_tokens=4, messages=ASK_WEATHER)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-9", max_tokens=4, messages=ASK_WEATHER)
    assert e.value.body["error"]["type"] == "not_found_error"
    for bad in ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                {"messages": ASK_WEATHER + [{"role": "assistant", "content": "Sure"}]},
                {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
                {"frobnicate": 1}):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**{"model": MODEL, "max_tokens": 4, "messages": ASK_WEATHER,
                                      "extra_body": bad})
        assert e.value.body["error"]["type"] == "invalid_request_error" and e.value.body["error"]["message"]
    # Anthropic's x-api-key header works on these routes only; the OpenAI routes keep their error shape
    body = {"model": MODEL, "messages": ASK_WEATHER}
    ok = httpx.post(base + "/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY})
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 0
    wrong = httpx.post(base + "/v1/messages/count_tokens", json=body, headers={"x-api-key": "nope"})
    assert wrong.status_code == 401
    assert wrong.json() == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "Invalid or missing API key"}}
    assert httpx.get(base + "/v1/models", headers={"x-api-key": KEY}).status_code == 401
    openai_err = httpx.post(base + "/v1/chat/completions", json={"model": MODEL},
                            headers={"Authorization": f"Bearer {KEY}"})
    assert openai_err.status_code == 400 and set(openai_err.json()["error"]) == {"message", "type", "param", "code"}


def test_openapi_and_metrics_cover_the_routes(client, base):
    schema = httpx.get(base + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    op = schema["paths"]["/v1/messages"]["post"]
    assert "text/event-stream" in op["responses"]["200"]["content"]
    assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("AnthropicErrorResponse")
    assert {"bearer": []} in op["security"] and {"x-api-key": []} in op["security"]
    req = schema["components"]["schemas"]["AnthropicMessagesRequest"]
    assert req["additionalProperties"] is False and "max_tokens" in req["required"]
    assert "/v1/messages/count_tokens" in schema["paths"]
    before = scrape(base)
    r = client.messages.create(model=MODEL, max_tokens=5, messages=COUNT, extra_body=GREEDY)
    deadline = time.time() + 10
    while True:
        after = scrape(base)
        done = after["pagedllm:request_success_total[length]"] - before["pagedllm:request_success_total[length]"]
        if done >= 1 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert done == 1
    assert after["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"] == \
        r.usage.output_tokens
