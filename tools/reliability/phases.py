"""The reliability scenarios: each phase drives a pagedllm server over HTTP and returns its figures (requests,
statuses, 5xx, crashes, leaked KV blocks, RSS growth, ...) with ``passed`` and the reasons it failed. Phases on one
running server come first; those that start, stop or kill their own server after them. `python -m tools.reliability`
(``cli.py``) runs them at volume; tests/test_reliability.py runs them smaller.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import httpx

from pagedllm.bench.compare import _free_port, wait_healthy
from tools.reliability import fuzz
from tools.reliability.probes import (FAIL_TOKEN, GREEDY_PROMPTS, LOG_ERRORS, _gauges, _kv_clean, auth,
                                      greedy_outputs, kv_settled, server_info)
from pagedllm.server.errors import anthropic_route


# ---------------------------------------------------------------------- phases on one running server
def phase_fuzz(base: str, key: str | None, schema_examples: int, body_examples: int, seed: int = 0) -> dict:
    h = auth(key)
    info = server_info(base, h)
    before = greedy_outputs(base, h, info["model"])
    total = fuzz.Tally()
    t_hostile = fuzz.run_hostile(base, h, info["model"], info["max_model_len"], info["vocab_size"])
    t_bodies = fuzz.run_bodies(base, h, info["model"], info["vocab_size"], body_examples, seed)
    t_schema, schema_failures = fuzz.run_schemathesis(base, h, schema_examples, seed)
    for t in (t_hostile, t_bodies, t_schema):
        total.add(t)
    alive = httpx.get(base + "/health", timeout=10).status_code == 200
    after = greedy_outputs(base, h, info["model"])
    kv = kv_settled(base, h)
    problems = list(total.problems)
    if total.server_errors or total.no_response:
        problems.insert(0, f"{total.server_errors} 5xx, {total.no_response} without response")
    if total.client_errors != total.openai_shaped:
        problems.insert(0, f"{total.client_errors - total.openai_shaped} 4xx without the OpenAI error object")
    if schema_failures:
        problems.insert(0, f"schema checks failed: {schema_failures}")
    if not alive:
        problems.insert(0, "the server is not healthy after fuzzing")
    if before != after:
        problems.insert(0, "greedy outputs changed after fuzzing")
    problems += _kv_clean(kv)
    return {"phase": "fuzz", "requests": total.sent, "hostile": t_hostile.as_dict(), "bodies": t_bodies.as_dict(),
            "schemathesis": {**t_schema.as_dict(), "check_failures": schema_failures}, "total": total.as_dict(),
            "greedy_unchanged": before == after, "healthy_after": alive, "kv": kv,
            "passed": not problems, "problems": problems[:20]}


async def _one_request(client: httpx.AsyncClient, path: str, body: dict, cut: str, rng: random.Random) -> str:
    """Send one request and maybe hang up: 'early' (before or around the first byte), 'mid' (after some
    stream events) or 'none'. Returns what happened."""
    async def run() -> str:
        if not body.get("stream"):
            r = await client.post(path, json=body)
            return _status(r)
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return _status(r)
            events, stop_after = 0, rng.randint(1, 12)
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if cut == "mid" and events >= stop_after:
                        return "cut mid-stream"
                    if line == "data: [DONE]":
                        return "completed"
            return "stream ended without [DONE]"

    if cut == "early":
        try:
            return await asyncio.wait_for(run(), timeout=rng.uniform(0.0, 0.4))
        except asyncio.TimeoutError:
            return "cut early"
    return await run()


def _status(r: httpx.Response) -> str:
    """'status 200', or the status with the error message's start ('status 503: the request waited ...')."""
    if r.status_code == 200:
        return "status 200"
    try:
        return f"status {r.status_code}: {r.json()['error']['message'][:60]}"
    except (ValueError, KeyError, TypeError):
        return f"status {r.status_code}"


def _bad_outcomes(outcomes: dict[str, int]) -> dict[str, int]:
    """Outcomes that are failures: a 5xx other than 503 (overloaded: a correct answer under load), a client-side
    error (connection reset, protocol error) or a stream that ended without [DONE]."""
    return {k: v for k, v in outcomes.items()
            if (k.startswith("status 5") and not k.startswith("status 503"))
            or k.startswith(("client error", "stream ended"))}


def _mixed_body(model: str, rng: random.Random, i: int) -> tuple[str, dict]:
    stream = rng.random() < 0.75
    n = 2 if rng.random() < 0.15 else 1
    common = {"model": model, "max_tokens": rng.randint(4, 48), "stream": stream, "n": n,
              "temperature": rng.choice([0.0, 0.8])}
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": f"{rng.choice(GREEDY_PROMPTS)} (variant {i})"}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"Tell me about {i}."}]}


async def _storm(base: str, headers: dict, model: str, n: int, concurrency: int, seed: int,
                 cut_fraction: float = 0.67) -> dict:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    outcomes: dict[str, int] = {}

    async def worker(i: int, client: httpx.AsyncClient):
        path, body = _mixed_body(model, rng, i)
        cut = rng.choice(["early", "mid"]) if rng.random() < cut_fraction else "none"
        async with sem:
            try:
                what = await _one_request(client, path, body, cut, rng)
            except httpx.HTTPError as e:
                what = f"client error {type(e).__name__}"
        outcomes[what] = outcomes.get(what, 0) + 1

    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120, limits=limits) as client:
        await asyncio.gather(*(worker(i, client) for i in range(n)))
    return outcomes


def phase_disconnects(base: str, key: str | None, n: int, concurrency: int, seed: int = 0) -> dict:
    h = auth(key)
    model = server_info(base, h)["model"]
    t0 = time.monotonic()
    outcomes = asyncio.run(_storm(base, h, model, n, concurrency, seed))
    elapsed = time.monotonic() - t0
    kv = kv_settled(base, h)
    problems = _kv_clean(kv)
    bad = _bad_outcomes(outcomes)
    if bad:
        problems.append(f"unexpected outcomes: {bad}")
    return {"phase": "disconnects", "requests": n, "concurrency": concurrency, "outcomes": outcomes,
            "duration_s": round(elapsed, 1), "kv": kv, "passed": not problems, "problems": problems}


def _rss(base: str, headers: dict) -> float:
    return _gauges(httpx.get(base + "/metrics", headers=headers, timeout=30).text)["process_resident_memory_bytes"]


def phase_soak(base: str, key: str | None, duration_s: float, concurrency: int = 8, seed: int = 1,
               max_growth: float = 0.05) -> dict:
    """Rounds of the disconnect storm for ``duration_s``; RSS sampled after each round. Growth = median RSS of
    the last third of the samples over the median of the first third (after one warm-up round)."""
    h = auth(key)
    model = server_info(base, h)["model"]
    before = greedy_outputs(base, h, model)
    asyncio.run(_storm(base, h, model, concurrency * 4, concurrency, seed))  # warm-up: allocator pools fill
    samples, outcomes, rounds, sent = [], {}, 0, 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < duration_s:
        for k, v in asyncio.run(_storm(base, h, model, concurrency * 4, concurrency, seed + rounds)).items():
            outcomes[k] = outcomes.get(k, 0) + v
        sent += concurrency * 4
        rounds += 1
        samples.append((round(time.monotonic() - t0, 1), _rss(base, h)))
    kv = kv_settled(base, h)
    after = greedy_outputs(base, h, model)
    third = max(len(samples) // 3, 1)
    first = statistics.median(s for _, s in samples[:third])
    last = statistics.median(s for _, s in samples[-third:])
    growth = last / first - 1
    problems = _kv_clean(kv)
    if growth > max_growth:
        problems.append(f"RSS grew {growth:.1%} (> {max_growth:.0%})")
    if before != after:
        problems.append("greedy outputs changed during the soak")
    bad = _bad_outcomes(outcomes)
    if bad:
        problems.append(f"unexpected outcomes: {bad}")
    return {"phase": "soak", "duration_s": round(time.monotonic() - t0, 1), "requests": sent, "rounds": rounds,
            "outcomes": outcomes, "rss_first_mib": round(first / 2**20, 1), "rss_last_mib": round(last / 2**20, 1),
            "rss_growth": round(growth, 4), "rss_samples": samples, "greedy_unchanged": before == after, "kv": kv,
            "passed": not problems, "problems": problems}


async def _timed_load(base: str, headers: dict, bodies: list[dict], concurrency: int,
                      timeout: float) -> tuple[list[dict], float]:
    """Send the bodies (at most ``concurrency`` at once); per request: status, Retry-After, completion tokens,
    error shape, seconds. Returns the results and the wall time."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def one(client, body) -> dict:
        async with sem:
            t0 = time.monotonic()
            try:
                r = await asyncio.wait_for(client.post("/v1/completions", json=body), timeout)
            except asyncio.TimeoutError:
                return {"status": "hung", "s": timeout}
            except httpx.HTTPError as e:
                return {"status": f"client error {type(e).__name__}", "s": time.monotonic() - t0}
            res = {"status": r.status_code, "s": time.monotonic() - t0, "retry_after": r.headers.get("retry-after"),
                   "tokens": 0, "shaped": True, "end": time.monotonic()}
            if r.status_code == 200:
                res["tokens"] = r.json()["usage"]["completion_tokens"]
            else:
                res["shaped"] = fuzz.error_shape(r)
            return res

    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=timeout + 5, limits=limits) as client:
        t0 = time.monotonic()
        results = await asyncio.gather(*(one(client, b) for b in bodies))
    for r in results:
        if "end" in r:
            r["end"] -= t0
    return results, time.monotonic() - t0


def phase_overload(base: str, key: str | None, max_num_seqs: int, burst: int, output_len: int = 128,
                   timeout: float = 300.0, min_ratio: float = 0.9) -> dict:
    """Overloaded: ``burst`` requests at once against a server started with --max-waiting-requests /
    --max-queue-delay-ms; every request must end with 200 or 429/503 + Retry-After and the OpenAI error object.
    Unloaded: the same number of requests as were admitted, sent by ``max_num_seqs`` clients (the batch full,
    nothing queued or refused); the admitted requests' output tokens/s is compared with it."""
    h = auth(key)
    model = server_info(base, h)["model"]
    prompts = [f"{GREEDY_PROMPTS[i % len(GREEDY_PROMPTS)]} #{i}" for i in range(max(burst, 4 * max_num_seqs))]

    def body(i: int) -> dict:
        return {"model": model, "prompt": prompts[i], "max_tokens": output_len, "ignore_eos": True,
                "temperature": 0}

    loaded, _ = asyncio.run(_timed_load(base, h, [body(i) for i in range(burst)], burst, timeout))
    ok = [r for r in loaded if r["status"] == 200]
    window = max((r["end"] for r in ok), default=0.0)
    tok_loaded = sum(r["tokens"] for r in ok) / window if window else 0.0
    # the same admitted work again, without the refused crowd: the same tail (a last, partly full batch)
    unloaded, t_unloaded = asyncio.run(_timed_load(base, h, [body(i) for i in range(max(len(ok), 1))],
                                                   max_num_seqs, timeout))
    tok_unloaded = sum(r.get("tokens", 0) for r in unloaded) / t_unloaded
    statuses: dict[str, int] = {}
    for r in loaded:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    refused = [r for r in loaded if r["status"] in (429, 503)]
    problems = []
    if any(r["status"] not in (200, 429, 503) for r in loaded):
        problems.append(f"statuses other than 200/429/503: {statuses}")
    if any(not r.get("retry_after") for r in refused):
        problems.append("a 429/503 without Retry-After")
    if any(not r.get("shaped", True) for r in loaded):
        problems.append("an error without the OpenAI error object")
    if any(r["status"] != 200 for r in unloaded):
        problems.append(f"the unloaded run had failures: {[r['status'] for r in unloaded if r['status'] != 200]}")
    ratio = tok_loaded / tok_unloaded if tok_unloaded else 0.0
    if ratio < min_ratio:
        problems.append(f"admitted throughput {tok_loaded:.1f} tok/s is {ratio:.0%} of unloaded {tok_unloaded:.1f}")
    kv = kv_settled(base, h)
    problems += _kv_clean(kv)
    return {"phase": "overload", "burst": burst, "statuses": statuses, "admitted": len(ok), "refused": len(refused),
            "hung": statuses.get("hung", 0), "unloaded_tok_s": round(tok_unloaded, 1),
            "admitted_tok_s": round(tok_loaded, 1), "ratio": round(ratio, 3),
            "max_latency_s": round(max(r["s"] for r in loaded), 1), "kv": kv, "passed": not problems,
            "problems": problems}


def phase_auth(base: str, key: str, metrics_public: bool = True) -> dict:
    """Every route in the OpenAPI schema, plus the docs, without a key, with a wrong one and with the right one (as a
    bearer key; as `x-api-key` too, which only the Anthropic Messages API routes accept)."""
    schema = httpx.get(base + "/openapi.json", headers=auth(key), timeout=30).json()
    routes = [(m.upper(), p) for p, ops in schema["paths"].items() for m in ops]
    routes += [("GET", "/openapi.json"), ("GET", "/docs")]
    public = {"/health"} | ({"/metrics"} if metrics_public else set())
    wrong = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {key}x"},
             {"Authorization": f"Basic {key}"}, {"Authorization": key}, {"x-api-key": "wrong"}]
    checked, problems = 0, []
    with httpx.Client(base_url=base, timeout=60) as c:
        for method, path in routes:
            kw = {"json": {}} if method == "POST" else {}
            for hdr in wrong:
                s = c.request(method, path, headers=hdr, **kw).status_code
                checked += 1
                if path in public and s == 401:
                    problems.append(f"{method} {path} is public but answered 401")
                if path not in public and s != 401:
                    problems.append(f"{method} {path} with {hdr or 'no key'} answered {s}, not 401")
            s = c.request(method, path, headers=auth(key), **kw).status_code
            checked += 1
            if s == 401:
                problems.append(f"{method} {path} refused the right key")
            if path not in public:
                s = c.request(method, path, headers={"x-api-key": key}, **kw).status_code
                checked += 1
                if (s == 401) == anthropic_route(path):
                    problems.append(f"{method} {path} answered {s} to the right key as x-api-key")
    return {"phase": "auth", "routes": len(routes), "requests": checked, "public": sorted(public),
            "passed": not problems, "problems": problems}


def phase_forward_fault(base: str, key: str | None, fail_token: int = FAIL_TOKEN) -> dict:
    """On a server started with --fault-injection '{"forward_fail_token": T}': requests carrying T fail (500) in
    the same batches as good ones, which must still produce exactly their solo greedy output."""
    h = auth(key)
    model = server_info(base, h)["model"]
    solo = greedy_outputs(base, h, model, max_tokens=32)

    async def run():
        async with httpx.AsyncClient(base_url=base, headers=h, timeout=120) as c:
            good = [asyncio.ensure_future(c.post("/v1/completions", json={
                "model": model, "prompt": p, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "logprobs": 0}))
                for p in GREEDY_PROMPTS]
            await asyncio.sleep(0.3)
            bad = [asyncio.ensure_future(c.post("/v1/completions", json={
                "model": model, "prompt": [1, 2, fail_token, 3 + i], "max_tokens": 4})) for i in range(3)]
            return await asyncio.gather(*good), await asyncio.gather(*bad)

    good, bad = asyncio.run(run())
    problems = []
    for r in bad:
        if r.status_code != 500 or "injected fault" not in r.json()["error"]["message"]:
            problems.append(f"a poisoned request answered {r.status_code}: {r.text[:200]}")
    batched = [r.json()["choices"][0]["logprobs"]["tokens"] if r.status_code == 200 else None for r in good]
    if batched != solo:
        problems.append("good requests batched with failing ones differ from their solo greedy output")
    kv = kv_settled(base, h)
    problems += _kv_clean(kv)
    return {"phase": "forward fault", "faults_injected": len(bad), "good_requests": len(good),
            "good_identical": batched == solo, "kv": kv, "passed": not problems, "problems": problems}


def phase_server_log(path: str) -> dict:
    """The shared server's log after all its phases: no unhandled error, no dead engine loop."""
    text = open(path).read()
    counts = {m: text.count(m) for m in LOG_ERRORS}
    problems = [f"{n} x {m!r} in {path}" for m, n in counts.items() if n]
    return {"phase": "server log", "lines": text.count("\n"), "counts": counts, "passed": not problems,
            "problems": problems}


# ---------------------------------------------------------------------- phases that own their server
def _launch(args: list[str], log_path: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", *args],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def phase_shutdown(server_args: list[str], workdir: str, drain_s: float = 3.0, streams: int = 4,
                   plain: int = 2) -> dict:
    """SIGTERM with requests in flight that outlast the drain timeout: each must end properly (its stream ends
    with [DONE], finish reason 'abort' or a normal one; a plain request gets its JSON) and the process must exit
    with 0 within drain + 5 s."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = os.path.join(workdir, "shutdown-server.log")
    proc = _launch(["--port", str(port), "--drain-timeout-s", str(drain_s), *server_args], log)
    wait_healthy(proc, base, log)
    info = server_info(base, {})
    body = {"model": info["model"], "prompt": GREEDY_PROMPTS[0], "max_tokens": info["max_model_len"] - 16,
            "ignore_eos": True}

    async def stream_one(c) -> str:
        try:
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                finish, done = None, False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        for ch in json.loads(line[6:]).get("choices", []):
                            finish = ch.get("finish_reason") or finish
                return f"finish {finish}" if done else "cut (no [DONE])"
        except httpx.HTTPError as e:
            return f"cut ({type(e).__name__})"

    async def plain_one(c) -> str:
        try:
            r = await c.post("/v1/completions", json=body)
            return f"finish {r.json()['choices'][0]['finish_reason']}" if r.status_code == 200 else f"{r.status_code}"
        except httpx.HTTPError as e:
            return f"cut ({type(e).__name__})"

    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            tasks = [asyncio.ensure_future(stream_one(c)) for _ in range(streams)]
            tasks += [asyncio.ensure_future(plain_one(c)) for _ in range(plain)]
            await asyncio.sleep(1.5)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            return results, t0

    results, t0 = asyncio.run(run())
    try:
        rc = proc.wait(timeout=drain_s + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "killed (did not exit)"
    exit_s = time.monotonic() - t0
    problems = []
    if any(r.startswith("cut") or not r.startswith("finish") for r in results):
        problems.append(f"requests not ended properly: {results}")
    if rc != 0:
        problems.append(f"exit code {rc}")
    if exit_s > drain_s + 5:
        problems.append(f"exited after {exit_s:.1f} s (drain {drain_s} s)")
    text = open(log).read()
    if "Traceback" in text:
        problems.append("a traceback in the server log")
    return {"phase": "shutdown", "in_flight": len(results), "outcomes": results, "exit_code": rc,
            "exit_s": round(exit_s, 1), "drain_s": drain_s, "passed": not problems, "problems": problems}


def phase_corrupt_models(workdir: str, model_path: str,
                         kinds: tuple[str, ...] = ("truncated", "garbage", "empty", "header-only")) -> dict:
    """Truncated, garbage, empty and header-only .gguf files: `pagedllm serve` must refuse each at start with a
    one-line error naming the file (exit code 2)."""
    size = os.path.getsize(model_path)
    files = {}
    with open(model_path, "rb") as f:
        head = f.read(size // 3)
    for name, data in (("truncated", head), ("garbage", os.urandom(4096)), ("empty", b""),
                       ("header-only", head[:2_000_000])):
        if name not in kinds:
            continue
        path = os.path.join(workdir, f"{name}.gguf")
        with open(path, "wb") as f:
            f.write(data)
        files[name] = path
    results, problems = {}, []
    for name, path in files.items():
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "pagedllm.cli.main", "serve", "--model", path, "--port", "1"],
                           capture_output=True, text=True, timeout=300)
        err = (p.stderr or "").strip().splitlines()
        last = err[-1] if err else ""
        results[name] = {"exit_code": p.returncode, "message": last[:300], "s": round(time.monotonic() - t0, 1)}
        if p.returncode == 0 or path not in last or "Traceback" in p.stderr:
            problems.append(f"{name}: exit {p.returncode}, message {last[:200]!r}")
    return {"phase": "corrupt model files", "files": results, "passed": not problems, "problems": problems}


def phase_tp_kill(server_args: list[str], workdir: str) -> dict:
    """A 3-rank tensor-parallel server (the default model divides by 3) whose other ranks are killed mid-stream:
    the stream ends with an error and the server stops with a non-zero exit and a message naming tensor
    parallelism."""
    import psutil

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = os.path.join(workdir, "tp-server.log")
    proc = _launch(["--port", str(port), "--tensor-parallel-size", "3", *server_args], log)
    wait_healthy(proc, base, log)
    model = server_info(base, {})["model"]
    victims = psutil.Process(proc.pid).children(recursive=True)

    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            try:
                async with c.stream("POST", "/v1/completions", json={
                        "model": model, "prompt": GREEDY_PROMPTS[1], "max_tokens": 200, "ignore_eos": True,
                        "stream": True}) as r:
                    lines = []
                    async for line in r.aiter_lines():
                        lines.append(line)
                        if len(lines) == 6:
                            for v in victims:
                                v.kill()
                    return lines
            except httpx.HTTPError as e:
                return [f"cut ({type(e).__name__})"]

    t0 = time.monotonic()
    lines = asyncio.run(run())
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "did not exit"
    text = open(log).read()
    problems = []
    if rc in (0, "did not exit"):
        problems.append(f"exit code {rc}")
    if "tensor parallel" not in text.lower():
        problems.append("the log does not name the tensor-parallel failure")
    told = any('"error"' in line for line in lines)
    return {"phase": "tensor-parallel rank killed", "workers_killed": len(victims), "exit_code": rc,
            "exit_s": round(time.monotonic() - t0, 1), "stream_got_error_event": told,
            "last_stream_line": (lines[-1] if lines else "")[:200], "passed": not problems, "problems": problems}
