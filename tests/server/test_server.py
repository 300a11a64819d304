"""The real server as a subprocess, driven by the official openai client and raw httpx."""

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from conftest import PROMPTS
from helpers import MODEL, free_port, scrape, start_server  # noqa: F401 - re-exported
from pagedllm import SamplingParams

API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, base, log = start_server(tmp_path_factory, "--api-key", API_KEY, "--max-request-body-bytes", "100000")
    yield proc, base, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def base(server):
    return server[1]


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0)


def auth():
    return {"Authorization": f"Bearer {API_KEY}"}


# ---------------------------------------------------------------------- openai client
def test_completion_and_usage(client, llm):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    offline = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert r.choices[0].text == offline.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_prompt_forms(client, llm):
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model=MODEL, prompt=[PROMPTS[0], PROMPTS[5]], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == by_text.choices[0].text  # greedy: n copies agree
    many_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=6, temperature=0)
    assert [c.text for c in many_ids.choices] == [by_text.choices[0].text] * 2


def test_chat_completion(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_completion_tokens=30, temperature=0,
    )
    assert r.choices[0].message.role == "assistant"
    assert "Paris" in r.choices[0].message.content
    assert r.usage.completion_tokens <= 30


def test_n_logprobs_echo(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, n=2, seed=5,
                                  logprobs=3)
    assert len(r.choices) == 2
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(len(t) <= 3 for t in lp.top_logprobs)
        assert "".join(lp.tokens) == c.text
    again = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, n=2, seed=5)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True)
    assert echo.choices[0].text.startswith(PROMPTS[0]) and len(echo.choices[0].text) > len(PROMPTS[0])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_streaming_chunks_arrive_incrementally(client):
    times, pieces = [], []
    t0 = time.monotonic()
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=64, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.text:
                times.append(time.monotonic() - t0)
                pieces.append(c.text)
    assert len(pieces) >= 30, "tokens were not streamed one chunk at a time"
    assert times[-1] - times[0] > 0.2, "all chunks arrived at once (buffered)"
    assert usage is not None and usage.completion_tokens == 64
    full = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=64, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert "".join(pieces) == full.choices[0].text


def test_chat_streaming_multibyte(client):
    prompt = "Repeat exactly: Grüße aus Köln — 日本語 🎉"
    kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=40, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    assert streamed == whole
    assert "\ufffd" not in streamed


def test_sixteen_concurrent_streams_match_offline(base, llm):
    prompts = [PROMPTS[i % len(PROMPTS)] + f" (variant {i})" for i in range(16)]
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    aclient = openai.AsyncOpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0)
    max_running = 0

    async def one(p):
        text = ""
        stream = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=32, temperature=0, stream=True)
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
        return text

    async def watch(stop):
        nonlocal max_running
        async with httpx.AsyncClient() as h:
            while not stop.is_set():
                text = (await h.get(base + "/metrics")).text
                for line in text.splitlines():
                    if line.startswith("pagedllm:num_requests_running{"):
                        max_running = max(max_running, float(line.split()[-1]))
                await asyncio.sleep(0.05)

    async def main():
        stop = asyncio.Event()
        w = asyncio.ensure_future(watch(stop))
        texts = await asyncio.gather(*(one(p) for p in prompts))
        stop.set()
        await w
        return texts

    texts = asyncio.run(main())
    assert texts == [o.outputs[0].text for o in offline]
    assert max_running >= 4, f"requests were not batched together (max running {max_running})"


def test_client_disconnect_aborts_and_frees_blocks(base):
    before = scrape(base)
    with httpx.stream("POST", base + "/v1/completions", headers=auth(), timeout=60,
                      json={"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 2000, "ignore_eos": True,
                            "stream": True}) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
            if got >= 5:
                break
    deadline = time.time() + 10
    while time.time() < deadline:
        m = scrape(base)
        if m["pagedllm:request_success_total[abort]"] > before["pagedllm:request_success_total[abort]"] and \
                m["pagedllm:num_requests_running"] == 0 and m["pagedllm:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.2)
    assert m["pagedllm:request_success_total[abort]"] == before["pagedllm:request_success_total[abort]"] + 1
    assert m["pagedllm:num_requests_running"] == 0
    assert m["pagedllm:kv_cache_usage_perc"] == 0
    assert m["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"] < 2000


def test_non_streaming_disconnect_aborts(base):
    before = scrape(base)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", headers=auth(), timeout=1.5,
                   json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 3000, "ignore_eos": True})
    deadline = time.time() + 10
    while time.time() < deadline:
        m = scrape(base)
        if m["pagedllm:request_success_total[abort]"] > before["pagedllm:request_success_total[abort]"]:
            break
        time.sleep(0.2)
    assert m["pagedllm:request_success_total[abort]"] == before["pagedllm:request_success_total[abort]"] + 1
    assert m["pagedllm:kv_cache_usage_perc"] == 0


def test_metrics_agree_with_requests(base, client):
    before = scrape(base)
    sent_completion = sent_prompt = 0
    for p in PROMPTS[:4]:
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0)
        sent_completion += r.usage.completion_tokens
        sent_prompt += r.usage.prompt_tokens
    after = scrape(base)
    assert after["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"] == sent_completion
    assert after["pagedllm:prompt_tokens_total"] - before["pagedllm:prompt_tokens_total"] == sent_prompt
    assert after["pagedllm:request_success_total[length]"] - before["pagedllm:request_success_total[length]"] == 4
    assert after["pagedllm:e2e_request_latency_seconds_count"] - before["pagedllm:e2e_request_latency_seconds_count"] == 4
    assert after["pagedllm:time_to_first_token_seconds_count"] - before["pagedllm:time_to_first_token_seconds_count"] == 4
    assert after["pagedllm:inter_token_latency_seconds_count"] - before["pagedllm:inter_token_latency_seconds_count"] == sent_completion - 4
    assert after["pagedllm:request_generation_tokens_sum"] - before["pagedllm:request_generation_tokens_sum"] == sent_completion
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "request_queue_time_seconds_count", "request_prompt_tokens_count", "iteration_tokens_total_count",
                 "num_requests_waiting"):
        assert f"pagedllm:{name}" in after
    assert after["pagedllm:prefix_cache_queries_total"] - before["pagedllm:prefix_cache_queries_total"] == sent_prompt
    # vLLM's names beside ours, the same values (llm-d's endpoint picker and vLLM dashboards read them)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total[length]", "time_to_first_token_seconds_count",
                 "e2e_request_latency_seconds_sum", "prefix_cache_hits_total"):
        assert after[f"vllm:{name}"] == after[f"pagedllm:{name}"], name
    assert not any(k.startswith("vllm:") and "circuit" in k for k in after)  # pagedllm's own stay pagedllm's


# ---------------------------------------------------------------------- other endpoints
def test_models_version_tokenize(base):
    models = httpx.get(base + "/v1/models", headers=auth()).json()
    assert models["data"][0]["id"] == MODEL
    version = httpx.get(base + "/version", headers=auth()).json()
    assert version["version"]
    assert version["runtime"]["max_num_batched_tokens"] == 2048  # the default step budget
    tok = httpx.post(base + "/tokenize", headers=auth(), json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    assert httpx.post(base + "/detokenize", headers=auth(),
                      json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello world"
    chat_tok = httpx.post(base + "/tokenize", headers=auth(),
                          json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tok["count"] > tok["count"]


# ---------------------------------------------------------------------- errors
def _err(r, status):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("payload, needle", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": "abc"}, "max_tokens"),
    ({"prompt": "hi", "top_p": 5}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n must be"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": ""}, "empty"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    # a hostile stop list is refused before it slows the steps other requests share (OpenAI takes 4)
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(1000)]}, "at most 32 strings"),
    ({"prompt": "hi", "stop": ["x" * 5000]}, "at most 1024 characters"),
])
def test_invalid_params_400(base, payload, needle):
    e = _err(httpx.post(base + "/v1/completions", headers=auth(), json={"model": MODEL, **payload}), 400)
    assert needle in e["message"] or needle == e["param"]


# the bodies vllm-router 0.1.17 (`vllm-router --policy cache_aware --worker-urls ...`) forwards for a plain completion
# and chat request: SGLang's and vLLM's extension fields at their defaults, written into every request
ROUTER_COMPLETION = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
                     "skip_special_tokens": True, "return_hidden_states": False}
ROUTER_CHAT = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
               "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}


def test_router_fields_at_their_defaults_are_answered(base):
    """A replica behind vllm-router or sglang-router: their extension fields at the values that ask for what
    pagedllm does anyway are accepted (the answer is the one without them); SGLang's ``no_stop_trim`` is vLLM's
    ``include_stop_str_in_output``; a value that would change the answer (hidden states, a continued final message,
    reasoning dropped) is a 400 naming the field."""
    msgs = [{"role": "user", "content": "Say hi"}]
    plain = httpx.post(base + "/v1/completions", headers=auth(),
                       json={"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0})
    routed = httpx.post(base + "/v1/completions", headers=auth(),
                        json={"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0,
                              **ROUTER_COMPLETION})
    assert routed.status_code == plain.status_code == 200, routed.text
    assert routed.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    chat = httpx.post(base + "/v1/chat/completions", headers=auth(),
                      json={"model": MODEL, "messages": msgs, "max_tokens": 6, "temperature": 0, **ROUTER_CHAT})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"], chat.text
    text = plain.json()["choices"][0]["text"]
    stop = text.strip()[:2]  # a stop string the greedy answer reaches
    kept = []
    for trim in ({"no_stop_trim": True}, {"include_stop_str_in_output": True}, {}):
        r = httpx.post(base + "/v1/completions", headers=auth(),
                       json={"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0, "stop": [stop],
                             **trim})
        kept.append(r.json()["choices"][0]["text"])
    assert kept[0] == kept[1] != kept[2] and kept[0].endswith(stop) and not kept[2].endswith(stop), kept
    for route, body, field in [("/v1/completions", {"prompt": "hi", "return_hidden_states": True},
                                "return_hidden_states"),
                               ("/v1/chat/completions", {"messages": msgs, "continue_final_message": True},
                                "continue_final_message"),
                               ("/v1/chat/completions", {"messages": msgs, "include_reasoning": False},
                                "include_reasoning"),
                               ("/v1/chat/completions", {"messages": msgs, "lora_path": "adapter"}, "lora_path")]:
        e = _err(httpx.post(base + route, headers=auth(), json={"model": MODEL, "max_tokens": 2, **body}), 400)
        assert e["param"] == field and field in e["message"], (body, e)


def test_invalid_json_and_chat_schema_400(base):
    _err(httpx.post(base + "/v1/completions", headers={**auth(), "content-type": "application/json"},
                    content=b"{not json"), 400)
    e = _err(httpx.post(base + "/v1/chat/completions", headers=auth(),
                        json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}), 400)
    assert "messages" in e["message"]


def test_context_length_errors(base):
    maxlen = httpx.get(base + "/v1/models", headers=auth()).json()["data"][0]["max_model_len"]
    e = _err(httpx.post(base + "/v1/completions", headers=auth(),
                        json={"model": MODEL, "prompt": [5] * (maxlen + 10), "max_tokens": 1}), 400)
    assert f"maximum context length is {maxlen}" in e["message"] and str(maxlen + 10) in e["message"]
    e = _err(httpx.post(base + "/v1/completions", headers=auth(),
                        json={"model": MODEL, "prompt": [5] * 100, "max_tokens": maxlen}), 400)
    assert f"maximum context length is {maxlen}" in e["message"] and str(100 + maxlen) in e["message"]


def test_unknown_model_404_and_auth_401(base):
    e = _err(httpx.post(base + "/v1/completions", headers=auth(), json={"model": "gpt-9", "prompt": "hi"}), 404)
    assert "gpt-9" in e["message"]
    _err(httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi"}), 401)
    _err(httpx.post(base + "/v1/completions", headers={"Authorization": "Bearer wrong"},
                    json={"model": MODEL, "prompt": "hi"}), 401)
    assert httpx.get(base + "/health").status_code == 200  # health needs no key


def test_body_too_large_413(base):
    _err(httpx.post(base + "/v1/completions", headers=auth(), json={"model": MODEL, "prompt": "x" * 200_000}), 413)


def test_bad_flag_value_stops_start():
    r = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--tensor-parallel-size", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "tensor_parallel_size=2 does not divide the model" in r.stderr and "9 query heads, 3 KV heads" in r.stderr


def test_stats_line_logged(server):
    log = server[2]
    deadline = time.time() + 5
    while time.time() < deadline and "Avg generation throughput" not in log.read_text():
        time.sleep(0.2)
    line = next(l for l in log.read_text().splitlines() if "Avg generation throughput" in l)
    for part in ("Running:", "Waiting:", "KV cache usage:", "Prefix cache hit rate:"):
        assert part in line


def test_bench_serve_against_server(base, tmp_path):
    """`pagedllm bench serve` end to end: every metric present and consistent with what the server reported."""
    out = tmp_path / "bench.json"
    before = scrape(base)
    r = subprocess.run(
        [sys.executable, "-m", "pagedllm.cli.main", "bench", "serve", "--base-url", base, "--api-key", API_KEY,
         "--num-prompts", "6", "--max-concurrency", "3", "--output-len", "8", "--dataset", "file", "--ignore-eos",
         "--goodput", "ttft:60000", "--result-json", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "Output token throughput" in r.stdout
    res = json.loads(out.read_text())
    for key in ("completed", "failed", "duration_s", "request_throughput", "output_throughput",
                "total_token_throughput", "goodput"):
        assert key in res
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            assert res[f"{stat}_{m}_ms"] >= 0
    assert res["completed"] == 6 and res["failed"] == 0 and res["goodput"] > 0
    assert res["total_output_tokens"] == 48
    for req in res["requests"]:
        assert 0 < req["ttft"] <= req["latency"]
        assert req["output_tokens"] == 8 and len(req["itl"]) <= 7
    after = scrape(base)
    assert after["pagedllm:generation_tokens_total"] - before["pagedllm:generation_tokens_total"] == 48
    assert after["pagedllm:prompt_tokens_total"] - before["pagedllm:prompt_tokens_total"] == res["total_input_tokens"]
    assert res["mean_ttft_ms"] <= res["mean_e2el_ms"]


def test_chat_template_kwargs_reach_the_template(client):
    """vLLM's ``chat_template_kwargs``: passed to the template (a reserved name is a 400 naming it), and a variable
    the template ignores changes nothing."""
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    same = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert same.usage.prompt_tokens == plain.usage.prompt_tokens
    assert same.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})


def test_embeddings_endpoint(client, base, llm):
    """`/v1/embeddings` with the official client (which asks for base64 and decodes it) equals the offline vectors;
    floats, mean pooling, token-id input, usage, and clear 400s."""
    before = scrape(base)
    r = client.embeddings.create(model=MODEL, input=[PROMPTS[0], PROMPTS[3]])
    after = scrape(base)
    offline = llm.embed([PROMPTS[0], PROMPTS[3]], use_tqdm=False)
    # the metrics count them: two finished requests, their prompt tokens, no generated token
    assert after["pagedllm:request_success_total[stop]"] - before["pagedllm:request_success_total[stop]"] == 2
    assert after["pagedllm:prompt_tokens_total"] - before["pagedllm:prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["pagedllm:generation_tokens_total"] == before["pagedllm:generation_tokens_total"]
    assert [d.index for d in r.data] == [0, 1]
    for d, o in zip(r.data, offline):
        assert d.embedding == pytest.approx(o.embedding, abs=1e-5)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(o.prompt_token_ids) for o in offline)
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    floats = httpx.post(base + "/v1/embeddings", headers=auth(), json={
        "model": MODEL, "input": ids, "encoding_format": "float"}).json()
    assert floats["object"] == "list" and floats["model"] == MODEL
    assert floats["data"][0]["embedding"] == pytest.approx(offline[0].embedding, abs=1e-5)
    mean = httpx.post(base + "/v1/embeddings", headers=auth(), json={
        "input": PROMPTS[0], "encoding_format": "float", "pooling": "mean", "normalize": False}).json()
    assert mean["data"][0]["embedding"] == pytest.approx(
        llm.embed(PROMPTS[0], pooling="mean", normalize=False, use_tqdm=False)[0].embedding, abs=1e-4)
    for payload, needle in [({"input": "hi", "dimensions": 8}, "dimensions"), ({"input": []}, "empty"),
                            ({"input": ["a", ""]}, "empty"), ({"input": "hi", "pooling": "max"}, "pooling"),
                            ({"input": "hi", "truncate": 3}, "truncate"), ({"input": [10**9]}, "out of range")]:
        e = _err(httpx.post(base + "/v1/embeddings", headers=auth(), json={"model": MODEL, **payload}), 400)
        assert needle in e["message"] or needle == e["param"], (payload, e)
    _err(httpx.post(base + "/v1/embeddings", headers=auth(), json={"model": "nope", "input": "hi"}), 404)
    _err(httpx.post(base + "/v1/embeddings", json={"input": "hi"}), 401)
    # scores need an embedding model (a chat model's pooled states are not trained for similarity)
    e = _err(httpx.post(base + "/v1/rerank", headers=auth(), json={"query": "x", "documents": ["a"]}), 400)
    assert "embedding model" in e["message"]
    _err(httpx.post(base + "/score", headers=auth(), json={"text_1": "x", "text_2": "a"}), 400)


def test_prompt_logprobs_and_echo_logprobs(client, base, llm):
    """vLLM's `prompt_logprobs` (completions and chat) and OpenAI's echo + logprobs, which covers the prompt's tokens
    too, streamed or not; they agree with the offline prompt logprobs."""
    offline = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2),
                           use_tqdm=False)[0]
    n_prompt = len(offline.prompt_token_ids)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == n_prompt and plp[0] is None
    for entry, lp in zip(plp[1:], offline.prompt_logprobs[1:]):
        assert entry[str(lp.token_id)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
        assert entry[str(lp.token_id)]["rank"] == lp.rank
        assert {str(t.token_id) for t in lp.top} <= set(entry) and len(entry) <= 3
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True,
                                     logprobs=1)
    lp = echo.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n_prompt] == pytest.approx([x.logprob for x in offline.prompt_logprobs[1:]], abs=1e-4)
    assert echo.choices[0].text == PROMPTS[0] + offline.outputs[0].text
    assert "".join(lp.tokens) == echo.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True,
                                       logprobs=1, stream=True)
    tokens, values = [], []
    for chunk in stream:
        c = chunk.choices[0]
        if c.logprobs is not None:
            tokens += c.logprobs.tokens
            values += c.logprobs.token_logprobs
    assert tokens == lp.tokens and values[0] is None
    assert values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    cplp = chat.model_extra["prompt_logprobs"]
    assert len(cplp) == chat.usage.prompt_tokens and cplp[0] is None and all(len(e) == 1 for e in cplp[1:])
    for path, body in [("/v1/completions", {"prompt": "hi", "stream": True, "prompt_logprobs": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                                 "prompt_logprobs": 1}),
                       ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21})]:
        e = _err(httpx.post(base + path, headers=auth(), json={"model": MODEL, **body}), 400)
        assert "prompt_logprobs" in e["message"] or e["param"] == "prompt_logprobs"


WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_responses_api(client, llm):
    """/v1/responses with the official SDK: text equal to the chat endpoint's, usage, incomplete at
    max_output_tokens, message items as input, a forced function call and its output sent back, text.format."""
    r = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=30,
                                temperature=0, store=False)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content":
                                                                  "What is the capital of France?"}],
                                          max_tokens=30, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content and r.output[0].type == "message"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    short = client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Tell me a long story."}]}], instructions="You are terse.",
        max_output_tokens=3, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 3 and short.instructions == "You are terse."
    call = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL],
                                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                   temperature=0)
    fc = [o for o in call.output if o.type == "function_call"]
    assert len(fc) == 1 and fc[0].name == "get_weather" and "city" in json.loads(fc[0].arguments)
    back = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "Weather in Paris?"}, fc[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": fc[0].call_id, "output": "22 C and sunny"}],
        tools=[WEATHER_TOOL], tool_choice="none", max_output_tokens=10, temperature=0)
    assert back.output_text and back.output[0].type == "message"
    assert back.usage.input_tokens > call.usage.input_tokens  # the call and its result were rendered
    js = client.responses.create(model=MODEL, input="Give a city.", max_output_tokens=40, temperature=0, text={
        "format": {"type": "json_schema", "name": "city", "schema": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}})
    assert isinstance(json.loads(js.output_text)["city"], str)


def test_responses_stream_matches_plain(client, base):
    kw = dict(model=MODEL, input="Name three colors.", max_output_tokens=16, temperature=0)
    plain = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if plain.status == "completed" else "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == plain.output_text == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.id == events[0].response.id
    tool = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL], stream=True,
                                   tool_choice="required", max_output_tokens=40, temperature=0)
    items = [e.item for e in tool if e.type == "response.output_item.done"]
    assert [i.type for i in items] == ["function_call"] and items[0].name == "get_weather"
    for body, needle in [({"input": "hi", "store": True}, "store"),
                         ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"input": "hi", "tools": [{"type": "web_search"}]}, "function tools"),
                         ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                          "input_image"),
                         ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
                         ({"input": "hi", "frobnicate": 1}, "frobnicate"),
                         ({"input": "hi", "top_logprobs": 2}, "top_logprobs"),
                         ({"input": []}, "input")]:
        e = _err(httpx.post(base + "/v1/responses", headers=auth(), json={"model": MODEL, **body}), 400)
        assert needle in e["message"] or needle == e["param"], (body, e)


def test_sigterm_finishes_in_flight_and_exits_cleanly(server):
    """Last in this module: SIGTERM while a stream is running; the stream ends properly, exit code 0. While it
    finishes the server still listens: /health is 503 (not ready: routers and load balancers move on) and new work is
    a 503, /metrics still answers."""
    proc, base, log = server
    done = {}

    async def consume(streaming: asyncio.Event):
        lines = []
        async with httpx.AsyncClient(timeout=60) as h:
            # 240 tokens: still streaming 0.8 s after the first one at 300 tok/s (the checks below take ~0.35 s)
            async with h.stream("POST", base + "/v1/completions", headers=auth(),
                                json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 240, "ignore_eos": True,
                                      "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        streaming.set()
        done["lines"] = lines

    async def main():
        streaming = asyncio.Event()
        task = asyncio.ensure_future(consume(streaming))
        # SIGTERM once the stream is under way (its first token arrived), not after a fixed wait: every token it
        # still has to make is waited for below
        await asyncio.wait_for(streaming.wait(), timeout=60)
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(timeout=10) as h:
            done["health"] = await h.get(base + "/health")
            done["new"] = await h.post(base + "/v1/completions", headers=auth(),
                                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            done["metrics"] = await h.get(base + "/metrics")
        done["running"] = not task.done()
        await task

    asyncio.run(main())
    assert proc.wait(timeout=60) == 0
    assert done["lines"][-1] == "data: [DONE]"
    assert done["running"]  # the checks ran while the stream was still going
    assert done["health"].status_code == 503 and "stopping" in done["health"].json()["error"]["message"]
    assert done["new"].status_code == 503 and done["metrics"].status_code == 200
    assert "Traceback" not in log.read_text()


def test_queue_bound_and_max_delay_errors(tmp_path_factory):
    """One slot, a queue of 2 and a 1.5 s queue delay: the 4th request is refused (429 + Retry-After), queued
    ones that wait too long get 503 "overloaded", and the server keeps serving."""
    proc, base, log = start_server(tmp_path_factory, "--max-num-seqs", "1", "--max-waiting-requests", "2",
                                   "--max-queue-delay-ms", "1500")

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=120) as h:
            body = {"prompt": PROMPTS[2], "max_tokens": 150, "ignore_eos": True}
            busy = asyncio.ensure_future(h.post("/v1/completions", json=body))
            await asyncio.sleep(0.5)
            queued = [asyncio.ensure_future(h.post("/v1/completions", json={**body, "max_tokens": 4}))
                      for _ in range(2)]
            await asyncio.sleep(0.3)
            refused = await h.post("/v1/completions", json={**body, "max_tokens": 4})
            results = await asyncio.gather(busy, *queued)
            after = await h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
            return refused, results, after

    try:
        refused, (busy, *queued), after = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    e = _err(refused, 429)
    assert e["type"] == "overloaded" and "queue is full" in e["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert busy.status_code == 200 and busy.json()["usage"]["completion_tokens"] == 150
    for q in queued:
        e = _err(q, 503)
        assert e["type"] == "overloaded" and "1500 ms" in e["message"]
        assert int(q.headers["retry-after"]) >= 1
    assert after.status_code == 200



def test_kv_cache_events_published_as_vllm_publishes_them(tmp_path_factory):
    """``--kv-events-config``: a ZMQ subscriber decoding with vLLM's event structs (vllm/distributed/kv_events.py
    as of vLLM 0.28: the batch array-like, the events tagged maps) sees, per step, [topic, sequence number, batch]; a prompt's full blocks arrive as
    ``BlockStored`` with the prompt's tokens, chained by their parent hashes; a repeated prompt (a cache hit) stores
    nothing new. A bad config stops the start with its message."""
    import msgspec
    import zmq

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None
        group_idx: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    port, replay_port = free_port(), free_port()
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                      "topic": "kv", "replay_endpoint": f"tcp://*:{replay_port}", "buffer_steps": 1000})
    proc, base, log = start_server(tmp_path_factory, "--kv-events-config", cfg)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.5)  # the subscription reaches the publisher (a PUB socket drops what no one subscribed to yet)
        prompt = " ".join(PROMPTS) * 2
        ids = httpx.post(base + "/tokenize", json={"prompt": prompt}).json()["tokens"]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        assert httpx.post(base + "/v1/completions", json=body).status_code == 200
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        stored, seqs, live = [], [], {}
        while sub.poll(2000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            seqs.append(int.from_bytes(seq, "big"))
            live[seqs[-1]] = payload
            stored += [e for e in decoder.decode(payload).events if isinstance(e, BlockStored)]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap
        # a subscriber that missed messages asks the replay socket (vLLM's protocol, a REQ client as in vLLM's
        # example subscriber): every buffered batch from the asked number on, the same bytes, then the end marker
        req = ctx.socket(zmq.REQ)
        req.connect(f"tcp://127.0.0.1:{replay_port}")
        req.send(seqs[0].to_bytes(8, "big"))
        assert req.poll(5000)
        first_seq, first_payload = req.recv_multipart()
        assert int.from_bytes(first_seq, "big") == seqs[0] and first_payload == live[seqs[0]]
        req.close(linger=0)
        dealer = ctx.socket(zmq.DEALER)  # a DEALER reads the whole replay
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send(seqs[0].to_bytes(8, "big"))
        replayed = []
        while dealer.poll(5000):
            seq_bytes, payload = dealer.recv_multipart()
            if payload == b"":
                assert seq_bytes == (-1).to_bytes(8, "big", signed=True)
                break
            replayed.append((int.from_bytes(seq_bytes, "big"), payload))
        dealer.close(linger=0)
        assert replayed == [(q, live[q]) for q in seqs]
        bs = stored[0].block_size
        full = len(ids) // bs
        assert [tuple(e.token_ids) for e in stored[:full]] == [tuple(ids[i * bs:(i + 1) * bs]) for i in range(full)]
        assert stored[0].parent_block_hash is None
        assert all(e.parent_block_hash == p.block_hashes[0] for p, e in zip(stored, stored[1:full]))
        assert httpx.post(base + "/v1/completions", json=body).status_code == 200  # a cache hit
        again = []
        while sub.poll(1000):
            again += [e for e in decoder.decode(sub.recv_multipart()[2]).events if isinstance(e, BlockStored)]
        assert not any(tuple(e.token_ids) == tuple(ids[:bs]) for e in again)
    finally:
        ctx.destroy(linger=0)  # every socket, whatever failed
        proc.terminate()
        proc.wait(timeout=60)
    bad = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--kv-events-config",
                          '{"enable_kv_cache_events": true, "publisher": "zmq", "buffer_steps": 0}'],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "buffer_steps must be a positive integer" in bad.stdout + bad.stderr
