"""`pagedllm bench compare`: one fixed workload through HuggingFace transformers (one at a time, static batches),
the pagedllm engine offline, the pagedllm server under `bench serve` at several concurrencies, and any peer
OpenAI-compatible servers the user started (`--peer NAME=URL`, e.g. llama.cpp's `llama-server`), measured by the same
client at the same concurrencies.

Every system gets the same prompts (the shipped set), the same number of output tokens (greedy, EOS ignored).
Offline systems receive all requests at t=0, so their latency includes waiting for earlier requests/batches, as a
naive deployment's users would see under a burst. Each offline phase runs in its own process so its peak RSS is
its own. Writes results.json, results.md and chart.png into the results directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shlex
import socket
import subprocess
import sys
import time
import urllib.parse

import httpx
import numpy as np

from pagedllm.bench.common import add_dtype_arg, add_workload_args
from pagedllm.bench.cpuinfo import cpu_info, cpu_line
from pagedllm.bench.offline import load_prompts
from pagedllm.bench.serve import BenchRequest, run_load
from pagedllm.config import default_model_path
from pagedllm.engine.llm import LLM
from pagedllm.engine.tokenizer import load_tokenizer
from pagedllm.reference.hf import load_hf_reference
from pagedllm.sampling_params import SamplingParams


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _row(system, n_out, duration, latencies, ttfts, peak_rss, **extra) -> dict:
    return {"system": system, "output_tokens": n_out, "duration_s": duration, "output_tok_s": n_out / duration,
            "mean_latency_s": float(np.mean(latencies)), "p99_latency_s": float(np.percentile(latencies, 99)),
            "mean_ttft_s": float(np.mean(ttfts)), "peak_rss_bytes": peak_rss, **extra}


# ---------------------------------------------------------------------- phases (each in its own process)
def phase_hf(prompts: list[str], output_len: int, batch_size: int, dtype: str) -> dict:
    import torch
    from tqdm import tqdm
    from transformers import LogitsProcessor, LogitsProcessorList

    tok, model = load_hf_reference(dtype)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    class FirstToken(LogitsProcessor):
        def __init__(self):
            self.t = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                self.t = time.perf_counter()
            return scores

    latencies, ttfts, n_out = [], [], 0
    t0 = time.perf_counter()
    label = "one at a time" if batch_size == 1 else f"static batches of {batch_size}"
    with torch.inference_mode():
        for i in tqdm(range(0, len(prompts), batch_size), desc=f"HF {dtype} {label}"):
            batch = prompts[i : i + batch_size]
            enc = tok(batch, return_tensors="pt", padding=True)
            ft = FirstToken()
            out = model.generate(**enc, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                 pad_token_id=tok.pad_token_id, logits_processor=LogitsProcessorList([ft]))
            done = time.perf_counter()
            n_out += (out.shape[1] - enc.input_ids.shape[1]) * len(batch)
            latencies += [done - t0] * len(batch)
            ttfts += [ft.t - t0] * len(batch)
    dt = time.perf_counter() - t0
    return _row(f"HF transformers {dtype}, {label}", n_out, dt, latencies, ttfts, _peak_rss())


def phase_offline(prompts: list[str], output_len: int, dtype: str, quantization: str | None = None,
                  model: str | None = None) -> dict:
    llm = LLM(model=model, dtype=dtype, quantization=quantization)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    engine = llm.engine
    peak_blocks = 0
    engine_step = engine.step

    def step():  # the KV blocks in use after each step: their peak is what this workload needed
        nonlocal peak_blocks
        out = engine_step()
        st = engine.stats()
        peak_blocks = max(peak_blocks, st.num_blocks - st.num_free_blocks)
        return out

    engine.step = step
    t0 = time.perf_counter()
    t0_mono = time.monotonic()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    kv = engine.kv_cache_spec()
    bytes_per_token = kv.bytes_per_token
    return _row(
        f"pagedllm offline LLM.generate ({engine.runtime['dtype']}, KV {engine.runtime['kv_cache_dtype']}"
        f"{_qlabel(quantization)})", n_out, dt,
        [o.metrics.last_token_time - t0_mono for o in outs], [o.metrics.first_token_time - t0_mono for o in outs],
        _peak_rss(),
        kv_bytes_used_peak=peak_blocks * kv.bytes_per_block,
        kv_bytes_static_max_len=len(prompts) * engine.max_model_len * bytes_per_token,
    )


def _server_label(dtype: str, quantization: str | None, extra: str = "") -> str:
    parts = ([] if dtype == "auto" else [dtype]) + ([f"--quantization {quantization}"] if quantization else [])
    parts += [extra] if extra else []
    return f" ({', '.join(parts)})" if parts else ""


def _qlabel(quantization: str | None) -> str:
    return f", --quantization {quantization}" if quantization else ""


# ---------------------------------------------------------------------- server phase
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=5).text.splitlines():
        if line.startswith("pagedllm:") and "{" in line:
            out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def wait_healthy(proc: subprocess.Popen, base: str, log_path: str, timeout: float = 300.0) -> None:
    """Until the server subprocess answers /health with 200; an exit or the timeout raises, naming its log."""

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # the start-up column's resolution (0.5 s before)
    proc.kill()
    raise RuntimeError(f"server did not become healthy within {timeout:.0f} s; see {log_path}")


def stop(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def running_server(dtype: str, quantization: str | None, extra: str, log_path: str):
    """A pagedllm server subprocess on a free port, healthy: yields (process, base URL); stopped on exit."""

    port = _free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--port", str(port),
                             "--dtype", dtype, "--log-stats-interval", "5",
                             *(["--quantization", quantization] if quantization else []), *extra.split()],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        wait_healthy(proc, base, log_path)
        proc.startup_s = time.monotonic() - t0  # launch to healthy: imports, load, kernels, KV cache
        yield proc, base
    finally:
        stop(proc, 60)
        log.close()


def load_args(base: str, concurrency: int) -> argparse.Namespace:
    """``bench serve``'s arguments for a greedy, EOS-ignoring run at a fixed concurrency."""
    return argparse.Namespace(base_url=base, endpoint="completions", model=None, api_key=None,
                              max_concurrency=concurrency, request_rate=float("inf"), burstiness=1.0, seed=0,
                              ignore_eos=True, temperature=0.0, goodput=None, dataset="file")


def _load_row(system: str, res: dict, **extra) -> dict:
    """A table row from a `run_load` result."""
    return {"system": system, "output_tokens": res["total_output_tokens"], "duration_s": res["duration_s"],
            "output_tok_s": res["output_throughput"], "mean_latency_s": res["mean_e2el_ms"] / 1000,
            "p99_latency_s": res["p99_e2el_ms"] / 1000, "mean_ttft_s": res["mean_ttft_ms"] / 1000,
            "failed": res["failed"], **extra}


def phase_server(prompts_file: str, n: int, output_len: int, concurrencies: list[int], dtype: str,
                 results_dir: str, quantization: str | None = None, extra: str = "") -> list[dict]:

    rows = []
    with running_server(dtype, quantization, extra, os.path.join(results_dir, "server.log")) as (proc, base):
        prompts = load_prompts(prompts_file)[:n]
        reqs = [BenchRequest(p, output_len) for p in prompts]
        capacity = _scrape(base)["pagedllm:kv_cache_capacity_bytes"]
        max_len = httpx.get(base + "/v1/models").json()["data"][0]["max_model_len"]
        started_peak = _hwm(proc.pid) or 0  # the start's own peak (loading the weights)
        for c in concurrencies:
            args = load_args(base, c)
            peak = {"usage": 0.0}
            fresh = _reset_hwm(proc.pid)  # else each row's peak includes the runs before it

            async def run_and_watch():
                stop = asyncio.Event()

                async def watch():
                    # every 20 ms for the first second (a smoke run's few short requests finish within 0.2 s), then
                    # every 0.2 s (each scrape costs the server a few ms)
                    t0 = asyncio.get_running_loop().time()
                    async with httpx.AsyncClient() as h:
                        while not stop.is_set():
                            for line in (await h.get(base + "/metrics")).text.splitlines():
                                if line.startswith("pagedllm:kv_cache_usage_perc{"):
                                    peak["usage"] = max(peak["usage"], float(line.rsplit(" ", 1)[1]))
                            fast = asyncio.get_running_loop().time() - t0 < 1.0
                            await asyncio.sleep(0.02 if fast else 0.2)

                w = asyncio.ensure_future(watch())
                res = await run_load(args, reqs, show_progress=True)
                stop.set()
                await w
                return res

            res = asyncio.run(run_and_watch())
            bytes_per_token = capacity / max(_scrape(base)["pagedllm:kv_cache_capacity_tokens"], 1)
            rows.append(_load_row(
                f"pagedllm server{_server_label(dtype, quantization, extra)}, concurrency {c}", res,
                kv_bytes_used_peak=peak["usage"] * capacity,
                kv_bytes_static_max_len=min(c, n) * max_len * bytes_per_token,
                # as a server started for this concurrency alone (a peer's is): the start's peak or this run's,
                # whichever is higher (without the reset: the server's peak so far, the earlier runs' included)
                peak_rss_bytes=max(started_peak, _hwm(proc.pid) or 0), peak_rss_per_run=fresh,
                startup_peak_rss_bytes=started_peak, startup_s=proc.startup_s,
            ))
    return rows


def _reset_hwm(pid: int) -> bool:
    """Reset a live process's VmHWM to its present resident set (``/proc/PID/clear_refs`` 5, Linux 4.0+): the
    next reading is that of what ran since. Returns whether it was reset."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm(pid: int) -> int | None:
    """A live process's peak resident set (VmHWM), bytes; None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _completions_ready(url: str, model: str) -> bool:
    return httpx.post(url + "/v1/completions", timeout=60, json={"model": model, "prompt": "Hi",
                                                                  "max_tokens": 1}).status_code == 200


@contextlib.contextmanager
def started_peer(name: str, cmd: str, log_path: str, ready=_completions_ready, **fmt):
    """A peer server started from ``cmd`` (``{port}`` and the ``fmt`` fields filled in), waited for until
    /v1/models answers and ``ready(url, model)`` holds: yields (process, url, model, start-up seconds); stopped
    on exit."""
    port = _free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(shlex.split(cmd.format(port=port, **fmt)), stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            t0, deadline = time.monotonic(), time.monotonic() + 300
            model = None
            while model is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"peer {name} did not start (exit {proc.poll()}); see {log_path}")
                try:
                    r = httpx.get(url + "/v1/models", timeout=1)
                    if r.status_code == 200 and ready(url, r.json()["data"][0]["id"]):
                        model = r.json()["data"][0]["id"]
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    time.sleep(0.25)
            yield proc, url, model, time.monotonic() - t0
        finally:
            stop(proc, 30)


def phase_peer_cmd(name: str, cmd: str, prompts: list[str], output_len: int, concurrencies: list[int],
                   results_dir: str, extra_body: dict | None = None) -> list[dict]:
    """A peer server that this phase starts itself, once per concurrency (``cmd``: its command line, where
    ``{port}``, ``{c}`` and ``{ctx}`` stand for a free port, the concurrency and 2048 x it, e.g. llama.cpp's
    slots and their context ``-np {c} -c {ctx}``), alone on
    the machine while it runs: its rows get the start-up time (launch to /v1/models answering) and peak RSS."""
    rows = []
    for c in concurrencies:
        log_path = os.path.join(results_dir, f"peer-{name}-c{c}.log")
        with started_peer(name, cmd, log_path, c=c, ctx=2048 * c) as (proc, url, model, startup):
            row = phase_peer(name, url, model, prompts, output_len, [c], extra_body)[0]
            row.update(peak_rss_bytes=_hwm(proc.pid), startup_s=startup, command=cmd)
            rows.append(row)
    return rows


# ---------------------------------------------------------------------- peer servers
def parse_peer(value: str) -> tuple[str, str]:
    """``--peer NAME=URL`` -> (name, base URL without a trailing slash); an argparse type."""
    name, sep, url = value.partition("=")
    name, url = name.strip(), url.strip().rstrip("/")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=URL (e.g. llama.cpp=http://127.0.0.1:8080), got {value!r}")
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise argparse.ArgumentTypeError(f"peer {name!r}: URL must be http(s)://HOST[:PORT], got {url!r}")
    return name, url


def parse_peer_cmd(value: str) -> tuple[str, str]:
    """``--peer-cmd NAME=COMMAND`` -> (name, command with {port} and optionally {c}); an argparse type."""
    name, sep, cmd = value.partition("=")
    if not sep or not name.strip() or "{port}" not in cmd:
        raise argparse.ArgumentTypeError(f"expected NAME=COMMAND with {{port}} in the command, got {value!r}")
    return name.strip(), cmd.strip()


def check_peer(name: str, url: str) -> str:
    """The model the peer serves (the first of its /v1/models); ValueError if it cannot be reached."""

    try:
        resp = httpx.get(url + "/v1/models", timeout=10)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"peer {name} at {url} is not an OpenAI-compatible server that answers GET /v1/models "
                         f"({type(e).__name__}: {e}); start it first, e.g. "
                         f"`llama-server -m MODEL.gguf --port 8080`") from None


def phase_peer(name: str, url: str, model: str, prompts: list[str], output_len: int,
               concurrencies: list[int], extra_body: dict | None = None) -> list[dict]:
    """The server phase's workload against a peer server: same prompts, streaming /v1/completions, greedy, EOS
    ignored (``ignore_eos``, honoured by llama.cpp's server and vLLM), same client; ``extra_body`` is merged into
    every request (by default ``cache_prompt: false``: llama.cpp's slots otherwise reuse the KV of a prompt they
    saw in an earlier phase, a prefix cache the pagedllm rows may have switched off)."""

    reqs = [BenchRequest(p, output_len) for p in prompts]
    rows = []
    for c in concurrencies:
        args = load_args(url, c)
        args.model = model
        args.extra_body = extra_body
        res = asyncio.run(run_load(args, reqs, show_progress=True))
        row = _load_row(f"peer {name}, concurrency {c}", res, peak_rss_bytes=None, url=url, model=model)
        if res["failed"]:
            print(f"warning: peer {name}: {res['failed']} of {len(reqs)} requests failed, first error: "
                  f"{res['errors'][0]}", file=sys.stderr)
        elif res["total_output_tokens"] != len(reqs) * output_len:
            print(f"warning: peer {name} generated {res['total_output_tokens']} tokens, not "
                  f"{len(reqs) * output_len}: it may not honour ignore_eos", file=sys.stderr)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------- report
def write_report(rows: list[dict], meta: dict, results_dir: str) -> str:
    with open(os.path.join(results_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    base = next((r["output_tok_s"] for r in rows if "one at a time" in r["system"]), rows[0]["output_tok_s"])
    lines = [
        f"Workload: {meta['num_prompts']} prompts (shipped set, {meta['prompt_tokens_min']}-"
        f"{meta['prompt_tokens_max']} tokens), {meta['output_len']} output tokens each, greedy, EOS ignored.",
    ]
    if meta.get("cpu"):
        lines.append(f"CPU: {cpu_line(meta['cpu'])}, {meta['cpus']} logical CPUs.")
    for name, peer in meta.get("peers", {}).items():
        lines.append(f"Peer {name}: {peer['url']}, model {peer['model']}.")
    lines += [
        "",
        "| system | output tok/s | vs HF one-at-a-time | mean latency (s) | p99 latency (s) | mean TTFT (s) | "
        "start-up (s) | peak RSS (MiB) | KV used / static max-len reservation |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kv = "—"
        if r.get("kv_bytes_static_max_len"):
            kv = (f"{r['kv_bytes_used_peak'] / 2**20:.0f} MiB / {r['kv_bytes_static_max_len'] / 2**20:.0f} MiB "
                  f"({100 * r['kv_bytes_used_peak'] / r['kv_bytes_static_max_len']:.1f}%)")
        rss = "—" if r.get("peak_rss_bytes") is None else f"{r['peak_rss_bytes'] / 2**20:.0f}"  # peers: unknown
        start = "—" if r.get("startup_s") is None else f"{r['startup_s']:.1f}"
        lines.append(
            f"| {r['system']} | {r['output_tok_s']:.1f} | {r['output_tok_s'] / base:.2f}x | {r['mean_latency_s']:.2f} | "
            f"{r['p99_latency_s']:.2f} | {r['mean_ttft_s']:.2f} | {start} | {rss} | {kv} |"
        )
    table = "\n".join(lines) + "\n"
    with open(os.path.join(results_dir, "results.md"), "w") as f:
        f.write(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["system"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 0.5 * len(rows) + 2.5))
    a1.barh(names, [r["output_tok_s"] for r in rows], color="tab:blue")
    a1.set_xlabel("output tokens/s (higher is better)")
    a2.barh(names, [r["p99_latency_s"] for r in rows], color="tab:orange")
    a2.set_xlabel("p99 request latency, s (lower is better)")
    a2.set_yticklabels([])
    for ax in (a1, a2):
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"pagedllm bench compare: {meta['num_prompts']} prompts x {meta['output_len']} tokens")
    fig.tight_layout()
    fig.savefig(os.path.join(results_dir, "chart.png"), dpi=110)
    plt.close(fig)
    return table


def _run_phase(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "pagedllm.bench.compare", *argv],
                         stdout=subprocess.PIPE, text=True, check=True)  # stderr (progress bars) passes through
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(args: argparse.Namespace) -> int:
    names = [name for name, _ in args.peer] + [name for name, _ in args.peer_cmd]
    if len(set(names)) != len(names):
        raise ValueError(f"--peer names must differ, got {names}")
    peers = {name: {"url": url, "model": check_peer(name, url)} for name, url in args.peer}  # before any measuring
    if args.quick:
        args.num_prompts, args.output_len = min(args.num_prompts, 4), min(args.output_len, 16)
        args.concurrency, args.hf_batch_sizes = [1, 4], [4]
    os.makedirs(args.results_dir, exist_ok=True)
    prompts = load_prompts(args.prompts_file)[: args.num_prompts]
    model = args.model or default_model_path()
    if args.model and not args.skip_hf:
        print("note: --model: the HF rows are for the embedded model only; skipping them", file=sys.stderr)
        args.skip_hf = True
    tok = load_tokenizer(model)
    lens = [len(tok.encode(p)) for p in prompts]
    meta = {"num_prompts": len(prompts), "output_len": args.output_len, "prompt_tokens_min": min(lens),
            "prompt_tokens_max": max(lens), "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
            "cpu": cpu_info(), "command": " ".join(sys.argv), "model": model}
    if peers:
        meta["peers"] = peers
    common = ["--num-prompts", str(len(prompts)), "--output-len", str(args.output_len)]
    server_args = args.server_args + (f" --model {shlex.quote(args.model)}" if args.model else "")
    if args.prompts_file:
        common += ["--prompts-file", args.prompts_file]
    rows = []
    if not args.skip_hf:
        for dt in args.hf_dtypes:
            rows.append(_run_phase(["--phase", "hf", "--batch-size", "1", "--dtype", dt, *common]))
            for b in args.hf_batch_sizes:
                rows.append(_run_phase(["--phase", "hf", "--batch-size", str(b), "--dtype", dt, *common]))
    qflag = ["--quantization", args.quantization] if args.quantization else []
    if not args.skip_offline:
        mflag = ["--model", args.model] if args.model else []
        rows.append(_run_phase(["--phase", "offline", "--dtype", args.dtype, *qflag, *mflag, *common]))
    rows += phase_server(args.prompts_file, len(prompts), args.output_len, args.concurrency, args.dtype,
                         args.results_dir, args.quantization, server_args)
    for name, peer in peers.items():
        rows += phase_peer(name, peer["url"], peer["model"], prompts, args.output_len, args.concurrency,
                           args.peer_extra_body)
    for name, cmd in args.peer_cmd:
        rows += phase_peer_cmd(name, cmd, prompts, args.output_len, args.concurrency, args.results_dir,
                               args.peer_extra_body)
    table = write_report(rows, meta, args.results_dir)
    print("\n" + table)
    print(f"results in {args.results_dir}/ (results.json, results.md, chart.png)")
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 32])
    p.add_argument("--hf-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    add_dtype_arg(p)
    p.add_argument("--quantization", default=None, help="pagedllm --quantization (e.g. gguf, int8)")
    p.add_argument("--server-args", default="", help="extra flags for the pagedllm server, e.g. "
                                                       "'--quant-dense-min-tokens 16'")
    p.add_argument("--peer", action="append", type=parse_peer, default=[], metavar="NAME=URL",
                   help="also measure an OpenAI-compatible server you started (e.g. llama.cpp's llama-server) with the "
                        "same workload and client; repeatable, e.g. --peer llama.cpp=http://127.0.0.1:8080")
    p.add_argument("--peer-extra-body", type=json.loads, default={"cache_prompt": False},
                   help="JSON merged into every peer request (default: llama.cpp's cache_prompt off, so its slots do "
                        "not reuse prompts from earlier phases; '{}' for servers that refuse unknown fields)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-offline", action="store_true", help="no offline LLM.generate row")
    p.add_argument("--model", default=None, help="the model file for the pagedllm rows (default: the embedded "
                   "model; another one skips the HF rows)")
    p.add_argument("--peer-cmd", action="append", type=parse_peer_cmd, default=[], metavar="NAME=COMMAND",
                   help="a peer server this command starts itself, alone, once per concurrency, with start-up time "
                        "and peak RSS: {port}, {c} (concurrency) and {ctx} (2048 x c) are filled in, e.g. --peer-cmd "
                        "'llama.cpp=llama-server -m FILE.gguf --port {port} -t 2 -np {c} -c {ctx}'")
    p.add_argument("--results-dir", default="results/compare")
    p.add_argument("--quick", action="store_true", help="4 prompts x 16 tokens: a smoke run")


def _phase_main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["hf", "offline"], required=True)
    p.add_argument("--batch-size", type=int, default=1)
    add_dtype_arg(p, default="float32")
    add_workload_args(p, num_prompts=None, output_len=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--model", default=None)
    a = p.parse_args()
    prompts = load_prompts(a.prompts_file)[: a.num_prompts]
    if a.phase == "hf":
        row = phase_hf(prompts, a.output_len, a.batch_size, "float32" if a.dtype == "auto" else a.dtype)
    else:
        row = phase_offline(prompts, a.output_len, a.dtype, a.quantization, a.model)
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(_phase_main())
