"""API fuzzing of a running server: schemathesis cases from its own `/openapi.json`, hypothesis-drawn OpenAI
bodies that mix valid and invalid values, and a fixed list of hostile requests (broken JSON, invalid UTF-8, NaN,
out-of-vocabulary ids, oversize bodies, bad Anthropic Messages requests, ...).

Every response is classified: 2xx, 4xx with the route's error object (OpenAI's; Anthropic's on `/v1/messages...`),
4xx without it, 5xx, or no response (the connection failed: a crash). Schema checks (status codes, content types and bodies as documented; invalid input
refused) are counted separately. Used by `python -m tools.reliability` and by tests/test_reliability.py.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from pagedllm.server.errors import anthropic_route

ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0  # 2xx
    client_errors: int = 0  # 4xx
    openai_shaped: int = 0  # 4xx with the route's error object: {"error": {message, type, param, code}} (OpenAI's)
    # or {"type": "error", "error": {type, message}} (Anthropic's, on its routes)
    server_errors: int = 0  # 5xx
    no_response: int = 0  # connection failed or timed out
    statuses: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # first few, for the report

    def problem(self, text: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(text[:400])

    def add(self, other: "Tally") -> None:
        for k in ("sent", "ok", "client_errors", "openai_shaped", "server_errors", "no_response"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.statuses.update(other.statuses)
        for p in other.problems:
            self.problem(p)

    def as_dict(self) -> dict:
        return {"sent": self.sent, "2xx": self.ok, "4xx": self.client_errors, "4xx_openai_shape": self.openai_shaped,
                "5xx": self.server_errors, "no_response": self.no_response,
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())}, "problems": self.problems}


def error_shape(resp: httpx.Response) -> bool:
    """Does the error carry its route's error object: Anthropic's on the Messages API routes
    (``{"type": "error", "error": {type, message}}``), else OpenAI's (``{"error": {message, type, param, code}}``)?"""
    try:
        body = resp.json()
    except ValueError:
        return False
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str) or not err["message"]:
        return False
    try:
        path = resp.request.url.path
    except RuntimeError:  # a response made by hand, without a request
        path = ""
    if anthropic_route(path):
        return body.get("type") == "error" and isinstance(err.get("type"), str)
    return ERROR_KEYS <= set(err) and err["code"] == resp.status_code


def check_anthropic_sse(text: str) -> str | None:
    """An Anthropic stream: `event: <type>` / `data: <JSON>` pairs from message_start to message_stop."""
    events = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if len(events) != len(data):
        return "stream has events without data (or data without event)"
    for name, d in zip(events, data):
        try:
            obj = json.loads(d)
        except ValueError:
            return f"stream event is not JSON: {d[:80]}"
        if obj.get("type") != name:
            return f"event {name!r} carries data of type {obj.get('type')!r}"
        if name == "error":
            return f"error inside a 200 stream: {obj.get('error')}"
    if not events or events[0] != "message_start" or events[-1] != "message_stop":
        return "stream does not run from message_start to message_stop"
    return None


def check_sse(text: str) -> str | None:
    """A stream must be `data: <JSON>` events ending with `data: [DONE]` (Anthropic's: `check_anthropic_sse`); an
    error event is reported."""
    if text.startswith("event: "):
        return check_anthropic_sse(text)
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "stream does not end with data: [DONE]"
    for e in events[:-1]:
        try:
            obj = json.loads(e)
        except ValueError:
            return f"stream event is not JSON: {e[:80]}"
        if "error" in obj:
            return f"error inside a 200 stream: {obj['error']}"
    return None


def classify(t: Tally, label: str, resp: httpx.Response | None, expect: set[int] | None = None) -> None:
    t.sent += 1
    if resp is None:
        t.no_response += 1
        t.problem(f"{label}: no response")
        return
    s = resp.status_code
    t.statuses[s] += 1
    if 200 <= s < 300:
        t.ok += 1
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            bad = check_sse(resp.text)
            if bad:
                t.problem(f"{label}: {bad}")
    elif 400 <= s < 500:
        t.client_errors += 1
        if error_shape(resp):
            t.openai_shaped += 1
        else:
            t.problem(f"{label}: {s} without the route's error shape: {resp.text[:200]}")
    elif s >= 500:
        t.server_errors += 1
        t.problem(f"{label}: {s}: {resp.text[:300]}")
    if expect is not None and s not in expect:
        t.problem(f"{label}: status {s}, expected {sorted(expect)}: {resp.text[:200]}")


def _send(client: httpx.Client, method: str, path: str, **kw) -> httpx.Response | None:
    """None when the server gave no response. A keep-alive connection that the server closed after its
    previous answer is retried once on a new connection (that is not a missing response)."""
    for attempt in range(2):
        try:
            return client.request(method, path, **kw)
        except (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError):
            if attempt:
                return None
        except httpx.HTTPError:
            return None
    return None


# ---------------------------------------------------------------------- hostile requests
def hostile_cases(model: str, max_model_len: int, vocab_size: int) -> list[tuple[str, str, str, dict, set[int]]]:
    """(label, method, path, httpx keyword arguments, expected statuses)."""
    c, chat = "/v1/completions", "/v1/chat/completions"
    js = {"content-type": "application/json"}
    ok_msg = [{"role": "user", "content": "Hi"}]
    long_text = "word " * (max_model_len + 50)

    def body(**kw):
        return {"json": {"model": model, **kw}}

    def raw(text: bytes | str):
        return {"content": text if isinstance(text, bytes) else text.encode(), "headers": js}

    bad400 = {400}
    cases = [
        ("invalid JSON", "POST", c, raw("{not json"), bad400),
        ("truncated JSON", "POST", c, raw('{"prompt": "hi", "max_tokens": '), bad400),
        ("JSON array body", "POST", c, raw("[1, 2, 3]"), bad400),
        ("JSON null body", "POST", c, raw("null"), bad400),
        ("empty body", "POST", c, raw(b""), bad400),
        ("invalid UTF-8", "POST", c, raw(b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}'), bad400),
        ("lone surrogate escape", "POST", c, raw('{"prompt": "\\ud800x", "max_tokens": 2}'), {200, 400}),
        ("text/plain content type", "POST", c, {"content": b'{"prompt": "hi"}', "headers": {"content-type":
                                                                                           "text/plain"}}, bad400),
        ("NaN temperature", "POST", c, raw('{"prompt": "hi", "temperature": NaN}'), bad400),
        ("Infinity temperature", "POST", c, raw('{"prompt": "hi", "temperature": Infinity}'), bad400),
        ("-Infinity presence_penalty", "POST", c, raw('{"prompt": "hi", "presence_penalty": -Infinity}'), bad400),
        ("1e309 top_p", "POST", c, raw('{"prompt": "hi", "top_p": 1e309}'), bad400),
        ("NaN logit_bias", "POST", c, raw('{"prompt": "hi", "logit_bias": {"5": NaN}}'), bad400),
        ("top_p 0", "POST", c, body(prompt="hi", top_p=0), bad400),
        ("top_p 1.5", "POST", c, body(prompt="hi", top_p=1.5), bad400),
        ("temperature -1", "POST", c, body(prompt="hi", temperature=-1), bad400),
        ("temperature string", "POST", c, body(prompt="hi", temperature="hot"), bad400),
        ("max_tokens negative", "POST", c, body(prompt="hi", max_tokens=-5), bad400),
        ("max_tokens 0", "POST", c, body(prompt="hi", max_tokens=0), bad400),
        ("max_tokens huge", "POST", c, body(prompt="hi", max_tokens=10**12), bad400),
        ("max_tokens 2**70", "POST", c, body(prompt="hi", max_tokens=2**70), bad400),
        ("max_tokens float", "POST", c, body(prompt="hi", max_tokens=2.5), bad400),
        ("n 0", "POST", c, body(prompt="hi", n=0), bad400),
        ("n 65", "POST", c, body(prompt="hi", n=65), bad400),
        ("n a million", "POST", c, body(prompt="hi", n=10**6), bad400),
        ("logprobs 21", "POST", c, body(prompt="hi", logprobs=21), bad400),
        ("logprobs -1", "POST", c, body(prompt="hi", logprobs=-1), bad400),
        ("chat top_logprobs 21", "POST", chat, body(messages=ok_msg, logprobs=True, top_logprobs=21), bad400),
        ("top_logprobs without logprobs", "POST", chat, body(messages=ok_msg, top_logprobs=3), bad400),
        ("seed 2**70", "POST", c, body(prompt="hi", seed=2**70), bad400),
        ("prompt missing", "POST", c, body(max_tokens=3), bad400),
        ("prompt empty", "POST", c, body(prompt=""), bad400),
        ("prompt empty list", "POST", c, body(prompt=[]), bad400),
        ("prompt number", "POST", c, body(prompt=12345), bad400),
        ("prompt nested junk", "POST", c, body(prompt=[["a"], {"b": 1}]), bad400),
        ("prompt over max_model_len", "POST", c, body(prompt=long_text, max_tokens=1), bad400),
        ("token ids over max_model_len", "POST", c, body(prompt=[5] * (max_model_len + 1), max_tokens=1), bad400),
        ("prompt + max_tokens over max_model_len", "POST", c, body(prompt=[5] * 10, max_tokens=max_model_len),
         bad400),
        ("out-of-vocabulary token id", "POST", c, body(prompt=[1, vocab_size + 5], max_tokens=1), bad400),
        ("negative token id", "POST", c, body(prompt=[1, -1], max_tokens=1), bad400),
        ("token id 2**40", "POST", c, body(prompt=[2**40], max_tokens=1), bad400),
        ("token id 2**70", "POST", c, body(prompt=[2**70], max_tokens=1), bad400),
        ("stop empty string", "POST", c, body(prompt="hi", stop=[""]), bad400),
        ("stop number", "POST", c, body(prompt="hi", stop=5), bad400),
        ("stop 100,000 strings", "POST", c, body(prompt="hi", stop=[f"s{i}" for i in range(100_000)]), bad400),
        ("stop string of 100,000 characters", "POST", c, body(prompt="hi", stop=["x" * 100_000]), bad400),
        ("stop_token_ids out of vocab", "POST", c, body(prompt="hi", stop_token_ids=[vocab_size]), bad400),
        ("logit_bias non-integer key", "POST", c, body(prompt="hi", logit_bias={"abc": 1}), bad400),
        ("logit_bias out of vocab", "POST", c, body(prompt="hi", logit_bias={str(vocab_size): 1}), bad400),
        ("logit_bias value 1e6", "POST", c, body(prompt="hi", logit_bias={"5": 1e6}), bad400),
        ("unknown field", "POST", c, body(prompt="hi", frobnicate=1), bad400),
        ("unknown model", "POST", c, {"json": {"model": "gpt-9", "prompt": "hi"}}, {404}),
        ("unknown model (chat)", "POST", chat, {"json": {"model": "gpt-9", "messages": ok_msg}}, {404}),
        ("chat messages empty", "POST", chat, body(messages=[]), bad400),
        ("chat messages string", "POST", chat, body(messages="hi"), bad400),
        ("chat message without role", "POST", chat, body(messages=[{"content": "hi"}]), bad400),
        ("chat role wizard", "POST", chat, body(messages=[{"role": "wizard", "content": "x"}]), bad400),
        ("chat image part", "POST", chat, body(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), bad400),
        ("chat content null", "POST", chat, body(messages=[{"role": "user", "content": None}], max_tokens=2),
         {200, 400}),
        ("chat 300 empty messages", "POST", chat, body(messages=[{"role": "user", "content": ""}] * 300,
                                                       max_tokens=2), {200, 400}),
        ("chat content number", "POST", chat, body(messages=[{"role": "user", "content": 5}]), bad400),
        ("response_format bogus", "POST", chat, body(messages=ok_msg, response_format={"type": "yaml"}), bad400),
        ("guided_regex invalid", "POST", c, body(prompt="hi", guided_regex="(unclosed"), bad400),
        ("guided_json invalid schema", "POST", c, body(prompt="hi", guided_json={"type": 12}), bad400),
        ("two constraints", "POST", c, body(prompt="hi", guided_regex="a+", guided_choice=["a"]), bad400),
        ("tool_choice without tools", "POST", chat, body(messages=ok_msg, tool_choice="required"), bad400),
        ("10 MB body", "POST", c, body(prompt="x" * (10 * 1024 * 1024)), {413}),
        ("detokenize out of vocab", "POST", "/detokenize", body(tokens=[vocab_size + 1]), bad400),
        ("detokenize negative", "POST", "/detokenize", body(tokens=[-3]), bad400),
        ("tokenize nothing", "POST", "/tokenize", body(), bad400),
        ("tokenize both", "POST", "/tokenize", body(prompt="a", messages=ok_msg), bad400),
        ("embeddings: empty input", "POST", "/v1/embeddings", body(input=[]), bad400),
        ("embeddings: empty string in list", "POST", "/v1/embeddings", body(input=["a", ""]), bad400),
        ("embeddings: token out of vocab", "POST", "/v1/embeddings", body(input=[vocab_size + 7]), bad400),
        ("embeddings: over context", "POST", "/v1/embeddings", body(input=[1] * (max_model_len + 5)), bad400),
        ("embeddings: dimensions", "POST", "/v1/embeddings", body(input="hi", dimensions=4), bad400),
        ("embeddings: bad encoding", "POST", "/v1/embeddings", body(input="hi", encoding_format="int8"), bad400),
        ("embeddings: input number", "POST", "/v1/embeddings", body(input=3.5), bad400),
        ("responses: store true", "POST", "/v1/responses", body(input="hi", store=True), bad400),
        ("responses: previous_response_id", "POST", "/v1/responses", body(input="hi", previous_response_id="r"),
         bad400),
        ("responses: input number", "POST", "/v1/responses", body(input=7), bad400),
        ("responses: empty input", "POST", "/v1/responses", body(input=[]), bad400),
        ("responses: unknown item", "POST", "/v1/responses", body(input=[{"type": "item_reference", "id": "x"}]),
         bad400),
        ("responses: function_call without call_id", "POST", "/v1/responses",
         body(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), bad400),
        ("responses: built-in tool", "POST", "/v1/responses", body(input="hi", tools=[{"type": "web_search"}]),
         bad400),
        ("responses: bad text.format", "POST", "/v1/responses", body(input="hi", text={"format": {"type": "x"}}),
         bad400),
        ("responses: max_output_tokens 0", "POST", "/v1/responses", body(input="hi", max_output_tokens=0), bad400),
        ("prompt_logprobs with stream", "POST", c, body(prompt="hi", stream=True, prompt_logprobs=1), bad400),
        ("prompt_logprobs 99", "POST", c, body(prompt="hi", prompt_logprobs=99), bad400),
        ("echo + logprobs", "POST", c, body(prompt="hi", echo=True, logprobs=2, max_tokens=2), {200}),
        ("unknown route", "GET", "/v1/nothing-here", {}, {404}),
        ("wrong method", "GET", c, {}, {405}),
    ]
    return cases + anthropic_hostile_cases(model)


def anthropic_hostile_cases(model: str) -> list[tuple[str, str, str, dict, set[int]]]:
    """Bad requests to the Anthropic Messages API routes (answered with Anthropic's error object)."""
    m, count = "/v1/messages", "/v1/messages/count_tokens"
    user = {"role": "user", "content": "Hi"}
    tool = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}

    def body(**kw):
        return {"json": {"model": model, "max_tokens": 4, "messages": [user], **kw}}

    bad400 = {400}
    return [
        ("messages: invalid JSON", "POST", m, {"content": b"{not json", "headers": {"content-type":
                                                                                   "application/json"}}, bad400),
        ("messages: max_tokens missing", "POST", m, {"json": {"model": model, "messages": [user]}}, bad400),
        ("messages: max_tokens 0", "POST", m, body(max_tokens=0), bad400),
        ("messages: temperature -1", "POST", m, body(temperature=-1), bad400),
        ("messages: empty", "POST", m, body(messages=[]), bad400),
        ("messages: system role in messages", "POST", m, body(messages=[{"role": "system", "content": "x"}]),
         bad400),
        ("messages: image block", "POST", m, body(messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]), bad400),
        ("messages: tool_result from the assistant", "POST", m, body(messages=[user, {"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}, user]), bad400),
        ("messages: final assistant message", "POST", m, body(messages=[user, {"role": "assistant",
                                                                                "content": "Sure"}]), bad400),
        ("messages: tool_choice tool without name", "POST", m, body(tools=[tool], tool_choice={"type": "tool"}),
         bad400),
        ("messages: tool_choice names an unknown tool", "POST", m, body(tools=[tool], tool_choice={
            "type": "tool", "name": "nope"}), bad400),
        ("messages: server tool", "POST", m, body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
         bad400),
        ("messages: stop_sequences empty string", "POST", m, body(stop_sequences=[""]), bad400),
        ("messages: unknown field", "POST", m, body(frobnicate=1), bad400),
        ("messages: unknown model", "POST", m, body(model="claude-9"), {404}),
        ("messages: wrong method", "GET", m, {}, {405}),
        ("count_tokens: max_tokens given", "POST", count, body(), bad400),
        ("count_tokens: messages missing", "POST", count, {"json": {"model": model}}, bad400),
    ]


def run_hostile(base: str, headers: dict, model: str, max_model_len: int, vocab_size: int,
                timeout: float = 120.0) -> Tally:
    t = Tally()
    with httpx.Client(base_url=base, headers=headers, timeout=timeout) as client:
        for label, method, path, kw, expect in hostile_cases(model, max_model_len, vocab_size):
            classify(t, label, _send(client, method, path, **kw), expect)
    return t


# ---------------------------------------------------------------------- hypothesis bodies
def body_strategy(model: str, vocab_size: int, chat: bool):
    """OpenAI bodies whose fields are drawn from valid values, edge values and wrong types alike."""
    from hypothesis import strategies as st

    junk = st.one_of(st.none(), st.booleans(), st.text(max_size=8), st.lists(st.integers(), max_size=3),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False, min_value=-5, max_value=5),
                       st.sampled_from([0.0, 1.0, -0.0, 1e-9, 1e300, -1e300]), junk)
    ints = st.one_of(st.integers(min_value=-3, max_value=24), st.sampled_from([2**31, 2**63, -(2**63), 10**12]),
                     junk)
    token = st.one_of(st.integers(min_value=0, max_value=vocab_size - 1),
                      st.sampled_from([vocab_size, vocab_size + 1, -1, 2**40]))
    text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
    fields = {
        "model": st.one_of(st.just(model), st.just("gpt-9"), junk),
        "max_tokens": st.one_of(st.integers(min_value=-2, max_value=12), ints),
        "temperature": floats, "top_p": floats, "top_k": ints, "min_p": floats, "n": st.one_of(
            st.integers(min_value=-1, max_value=3), ints),
        "seed": ints, "presence_penalty": floats, "frequency_penalty": floats, "repetition_penalty": floats,
        "stop": st.one_of(text, st.lists(text, max_size=3), junk),
        "stream": st.one_of(st.booleans(), junk), "ignore_eos": st.booleans(),
        "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(-2, vocab_size + 2).map(str), text), floats,
                                                max_size=2), junk),
        "stop_token_ids": st.one_of(st.lists(token, max_size=2), junk),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
        "priority": ints, "min_tokens": ints, "bogus_field": junk,
    }
    if chat:
        message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]),
                                         "content": st.one_of(text, st.none(), st.integers())})
        fields["messages"] = st.one_of(st.lists(message, min_size=1, max_size=3), st.lists(message, max_size=0),
                                       junk)
        fields["logprobs"] = st.one_of(st.booleans(), junk)
        fields["top_logprobs"] = ints
        required = ("messages",)
    else:
        fields["prompt"] = st.one_of(text, st.lists(token, min_size=0, max_size=12), st.lists(text, max_size=2),
                                     junk)
        fields["logprobs"] = ints
        fields["echo"] = st.one_of(st.booleans(), junk)
        required = ("prompt",)

    @st.composite
    def bodies(draw):
        out = {}
        for name, strat in fields.items():
            if name in required and draw(st.integers(0, 9)) > 0:
                out[name] = draw(strat)
            elif draw(st.integers(0, 3)) == 0:
                out[name] = draw(strat)
        if isinstance(out.get("max_tokens"), int) and out["max_tokens"] > 12:
            out["max_tokens"] = 12  # bound the work per case (huge values are in the hostile list)
        if isinstance(out.get("n"), int) and out["n"] > 3:
            out["n"] = 3
        return out

    return bodies()


def run_bodies(base: str, headers: dict, model: str, vocab_size: int, examples: int, seed: int = 0,
               timeout: float = 120.0) -> Tally:
    from hypothesis import HealthCheck, Phase, given, settings

    t = Tally()
    with httpx.Client(base_url=base, headers=headers, timeout=timeout) as client:
        for path, chat in (("/v1/completions", False), ("/v1/chat/completions", True)):
            @settings(max_examples=max(examples // 2, 1), database=None, deadline=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck), derandomize=seed == 0)
            @given(body_strategy(model, vocab_size, chat))
            def one(body):
                label = f"{path} {json.dumps(body, default=str)[:160]}"
                classify(t, label, _send(client, "POST", path, json=body))

            one()
    return t


# ---------------------------------------------------------------------- schemathesis
SCHEMA_CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
                 "response_schema_conformance", "negative_data_rejection")


def run_schemathesis(base: str, headers: dict, examples_per_operation: int, seed: int = 0,
                     timeout: float = 120.0, max_tokens_cap: int = 16) -> tuple[Tally, dict]:
    """Positive and negative cases for every operation in the server's /openapi.json. Returns the response tally
    and, per schemathesis check, how many responses failed it."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis import checks as st_checks

    raw = httpx.get(base + "/openapi.json", headers=headers, timeout=30).raise_for_status().json()
    for ops in raw.get("paths", {}).values():  # the key is sent with every case; auth has its own phase
        for op in ops.values():
            op.pop("security", None)
    raw.get("components", {}).pop("securitySchemes", None)
    schema = schemathesis.openapi.from_dict(raw)
    chosen = [getattr(st_checks, name) for name in SCHEMA_CHECKS]
    t = Tally()
    failed: Counter = Counter()
    ops = [r.ok() for r in schema.get_all_operations()]
    with httpx.Client(base_url=base, headers=headers, timeout=timeout) as client:
        for op in ops:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                @settings(max_examples=examples_per_operation, database=None, deadline=None,
                          phases=[Phase.generate], suppress_health_check=list(HealthCheck),
                          derandomize=seed == 0)
                @given(op.as_strategy(generation_mode=mode))
                def one(case):
                    _cap_work(case, max_tokens_cap)
                    kwargs = case.as_transport_kwargs(base_url=base, headers=headers)
                    kwargs.pop("base_url", None)
                    method, url = kwargs.pop("method"), kwargs.pop("url")
                    started = time.monotonic()
                    label = f"{mode.value} {op.label} {str(case.body)[:160]}"
                    try:
                        resp = client.request(method, url, **_httpx_kwargs(kwargs))
                    except httpx.HTTPError as e:
                        classify(t, label + f" ({type(e).__name__})", None)
                        return
                    classify(t, label, resp)
                    try:
                        case.validate_response(resp, checks=chosen, headers=headers)
                    except BaseException as e:  # noqa: BLE001 - schemathesis's FailureGroup is a BaseExceptionGroup
                        if isinstance(e, (KeyboardInterrupt, SystemExit)):
                            raise
                        names = _failed_checks(e)
                        failed.update(names)
                        t.problem(f"{label}: schema check {names} failed "
                                  f"({resp.status_code}, {time.monotonic() - started:.1f} s): {str(e)[:300]}")

                try:
                    one()
                except Unsatisfiable:  # nothing to make invalid (a GET without parameters)
                    pass
    return t, dict(failed)


def _cap_work(case, cap: int) -> None:
    """Positive cases may ask for max_tokens up to the context and n up to 64: keep each case quick."""
    body = case.body
    if isinstance(body, dict):
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = cap  # a chat request without it may run to the context length
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > cap:
                body[key] = cap
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
            body["n"] = 2


def _httpx_kwargs(kw: dict) -> dict:
    """schemathesis's transport arguments as httpx wants them (raw bytes as content; no cookies: the API has
    none)."""
    out = {}
    for k in ("headers", "params", "json", "content", "data", "files"):
        if kw.get(k) is not None:
            out[k] = kw[k]
    if isinstance(out.get("data"), (bytes, str)):
        out["content"] = out.pop("data")
    return out


def _failed_checks(e: Exception) -> list[str]:
    subs = getattr(e, "exceptions", None) or [e]
    names = []
    for s in subs:
        names.append(getattr(s, "title", None) or type(s).__name__)
    return names
