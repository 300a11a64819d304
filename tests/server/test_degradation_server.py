"""Fallback model, request timeout and circuit breaker on a real server, with injected primary faults."""

import json
import time

import httpx

from helpers import start_server

PRIMARY = "SmolLM2-135M-Instruct"
FALLBACK = "SmolLM2-135M-Instruct-fallback"


def test_fallback_timeout_and_breaker(tmp_path_factory):
    from pagedllm.config import default_model_path

    faults = json.dumps({"fail_marker": "FAILME", "stall_marker": "STALLME"})
    proc, base, log = start_server(
        tmp_path_factory, "--fallback-model", default_model_path(), "--request-timeout-s", "2",
        "--circuit-breaker-threshold", "3", "--circuit-breaker-cooldown-s", "3", "--fault-injection", faults)

    def complete(prompt, **kw):
        r = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, **kw},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-pagedllm-served-by"] == r.json()["model"]
        return r.json()["model"]

    def circuit():
        return httpx.get(base + "/health").json()["circuit"]["state"]

    def metric_state():
        for line in httpx.get(base + "/metrics").text.splitlines():
            if line.startswith("pagedllm:circuit_state{"):
                return float(line.rsplit(" ", 1)[1])

    try:
        assert complete("Hello there") == PRIMARY and circuit() == "closed"
        t0 = time.monotonic()
        assert complete("STALLME: the primary never starts") == FALLBACK  # after the 2 s timeout
        assert 2.0 <= time.monotonic() - t0 < 30
        assert circuit() == "closed"  # one failure, threshold 3
        for _ in range(2):
            assert complete("FAILME please") == FALLBACK
        assert circuit() == "open" and metric_state() == 1
        assert complete("Hello there") == FALLBACK  # open: straight to the fallback
        # streaming is routed the same way and says who served it
        with httpx.stream("POST", base + "/v1/completions", timeout=60,
                          json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
            assert r.headers["x-pagedllm-served-by"] == FALLBACK
            assert [l for l in r.iter_lines() if l.startswith("data: ")][-1] == "data: [DONE]"
        time.sleep(3.2)
        assert circuit() == "half_open"
        assert complete("Hello there") == PRIMARY  # the probe succeeds
        assert circuit() == "closed" and metric_state() == 0
        chat = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "FAILME"}], "max_tokens": 3})
        assert chat.status_code == 200 and chat.headers["x-pagedllm-served-by"] == FALLBACK
        assert httpx.post(base + "/v1/completions", timeout=60,
                          json={"model": FALLBACK, "prompt": "Hi", "max_tokens": 2}).json()["model"] == FALLBACK
    finally:
        proc.terminate()
        proc.wait(timeout=60)
