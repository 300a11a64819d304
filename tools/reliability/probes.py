"""What the reliability phases read off a running server: its model card, greedy outputs, the KV pool and the
Prometheus gauges once it settles, and whether they are back to idle; the prompts and markers the phases share."""

from __future__ import annotations

import time

import httpx

GREEDY_PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
                  "List three uses of copper:"]
LOG_ERRORS = ("unhandled error", "Exception in ASGI application", "engine loop died")  # never expected in a log
FAIL_TOKEN = 49150  # a valid id of the default model; the fault-injected server fails any batch holding it


def auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def server_info(base: str, headers: dict) -> dict:
    card = httpx.get(base + "/v1/models", headers=headers, timeout=30).json()["data"][0]
    return {"model": card["id"], "max_model_len": card["max_model_len"], "vocab_size": card["vocab_size"]}


def greedy_outputs(base: str, headers: dict, model: str, max_tokens: int = 24) -> list[list[int] | str]:
    """Each prompt alone, greedy: the text (compared token for token through its logprobs' tokens)."""
    out = []
    with httpx.Client(base_url=base, headers=headers, timeout=120) as c:
        for p in GREEDY_PROMPTS:
            r = c.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True, "logprobs": 0})
            r.raise_for_status()
            out.append(r.json()["choices"][0]["logprobs"]["tokens"])
    return out


def kv_settled(base: str, headers: dict, timeout: float = 20.0, gauges_within_s: float = 1.5) -> dict:
    """Poll /debug/kv until nothing runs or waits and every block is free (or the timeout); then read the
    Prometheus gauges too, until they are back to idle or ``gauges_within_s`` has passed (the engine loop publishes
    them when it next wakes: at once after a step, within its 1 s idle wait otherwise). Returns the last state with
    ``leaked_blocks`` and ``settle_s``."""
    t0 = time.monotonic()
    with httpx.Client(base_url=base, headers=headers, timeout=30) as c:
        while True:
            kv = c.get("/debug/kv").json()
            idle = kv["num_running"] == 0 and kv["num_waiting"] == 0 and kv["num_free_blocks"] == kv["num_blocks"]
            if idle or time.monotonic() - t0 > timeout:
                break
            time.sleep(0.2)
        # polled, not a fixed 1.5 s wait: gauges still off idle when the time is up are what the phase reports
        deadline = time.monotonic() + gauges_within_s
        while True:
            gauges = _gauges(c.get("/metrics").text)
            if not _gauge_problems(gauges) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    kv["leaked_blocks"] = kv["num_blocks"] - kv["num_free_blocks"]
    kv["settle_s"] = round(time.monotonic() - t0, 2)
    kv["gauges"] = {k: gauges.get(k) for k in ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
                                               "pagedllm:kv_cache_usage_perc", "pagedllm:kv_cache_free_blocks",
                                               "pagedllm:kv_cache_total_blocks")}
    return kv


def _gauges(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def _gauge_problems(g: dict[str, float]) -> list[str]:
    """What is off idle in the gauges: anything running or waiting, a KV block in use (none: idle)."""
    bad = []
    if (g.get("pagedllm:num_requests_running") or g.get("pagedllm:num_requests_waiting")
            or g.get("pagedllm:kv_cache_usage_perc")):
        bad.append(f"gauges not back to 0: {g}")
    if g.get("pagedllm:kv_cache_free_blocks") != g.get("pagedllm:kv_cache_total_blocks"):
        bad.append(f"free-block gauge {g.get('pagedllm:kv_cache_free_blocks')} != total")
    return bad


def _kv_clean(kv: dict) -> list[str]:
    bad = []
    if kv["leaked_blocks"] or not kv["consistent"]:
        bad.append(f"KV pool: {kv['leaked_blocks']} blocks not free, consistent={kv['consistent']} "
                   f"({kv.get('problem')})")
    if kv["num_running"] or kv["num_waiting"]:
        bad.append(f"{kv['num_running']} running / {kv['num_waiting']} waiting after the phase")
    return bad + _gauge_problems(kv["gauges"])
