"""`pagedllm bench overhead`: where a serving step's time goes, from a sampling profiler (py-spy) on a live server.

It starts a server, drives it with `bench serve` at a fixed concurrency, and samples the server's Python threads
with py-spy (idle samples included, so a waiting thread is seen as waiting). Each sample of the engine thread that
lies inside a step is put in one bucket: the model's forward pass (matmuls, attention, fused kernels, LM head),
sampling, input preparation, scheduling (with the KV block manager), output processing (detokenization, stop
strings, delivery to the request queues) or other engine-loop work. Samples where the HTTP thread is busy (FastAPI,
SSE streaming, asyncio) count as HTTP work: on a 2-core machine it competes with the step for the cores.

Engine overhead = everything in a step but the forward pass, plus the HTTP thread's busy time, as a share of the
time the engine spends in steps. py-spy must be installed (`pip install py-spy`); it is a benchmark tool, not a
dependency of the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from collections import Counter

from pagedllm.bench.common import add_dtype_arg, add_workload_args
from pagedllm.bench.compare import load_args, running_server
from pagedllm.bench.offline import load_prompts
from pagedllm.bench.serve import BenchRequest, run_load

# (bucket, markers): the first bucket one of whose markers is in a sample's stack takes it; order matters
# (the forward pass runs inside the model runner, sampling after it; building the sampling metadata, in
# pagedllm/sample/metadata.py, is input preparation, not sampling).
ENGINE_BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("model forward", ("pagedllm/model/", "pagedllm/layers/", "pagedllm/quant/linear.py", "pagedllm/kernels/")),
    ("input preparation", ("pagedllm/worker/step_inputs.py", "_step_tensors (", "_decode_metadata (",
                           "sampling_metadata")),
    ("sampling", ("pagedllm/sample/",)),
    ("scheduling", ("pagedllm/core/",)),
    ("output processing", ("pagedllm/engine/output_processor.py", "_deliver (", "detokeniz")),
]
IN_STEP = ("_step_locked (",)  # the engine thread's frame while it runs one step
ENGINE_THREAD = ("pagedllm/engine/async_engine.py",)
# leaves of a waiting thread; uvicorn runs uvloop where installed, whose event loop is C: a loop waiting in epoll
# shows ``Runner.run`` (asyncio's runner, which called it) as its innermost Python frame (the loop's own callbacks
# into Python show deeper frames, counted as busy)
IDLE_LEAVES = ("select (selectors.py)", "wait (threading.py)", "_worker (concurrent/futures/thread.py)",
               "get (queue.py)", "run_forever", "poll (", "sleep (", "Runner.run (asyncio/runners.py)")


def parse_raw(text: str) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) format: one 'frame;frame;...;leaf count' line per distinct stack."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        out.append((stack.split(";"), int(count)))
    return out


def classify(samples: list[tuple[list[str], int]]) -> dict:
    """Bucket counts: engine in-step buckets, 'engine waiting', 'HTTP busy', 'HTTP idle', 'other threads'."""
    counts: Counter = Counter()
    for frames, n in samples:
        joined = ";".join(frames)
        if any(m in joined for m in ENGINE_THREAD):
            if not any(m in joined for m in IN_STEP):
                counts["engine waiting"] += n
                continue
            for bucket, markers in ENGINE_BUCKETS:
                if any(m in joined for m in markers):
                    counts[bucket] += n
                    break
            else:
                counts["engine loop other"] += n
        elif "uvicorn" in joined or "asyncio" in joined or "starlette" in joined or "fastapi" in joined:
            counts["HTTP idle" if any(m in frames[-1] for m in IDLE_LEAVES) else "HTTP busy"] += n
        else:
            counts["other threads"] += n
    return dict(counts)


def summarize(counts: dict) -> dict:
    """Shares of the engine's in-step time; overhead = in-step non-forward + HTTP busy, over in-step time."""
    buckets = [b for b, _ in ENGINE_BUCKETS] + ["engine loop other"]
    in_step = sum(counts.get(b, 0) for b in buckets)
    if in_step == 0:
        raise ValueError("no sample of the engine inside a step: was the server under load while sampling?")
    shares = {b: counts.get(b, 0) / in_step for b in buckets}
    shares["HTTP busy (concurrent)"] = counts.get("HTTP busy", 0) / in_step
    overhead = 1.0 - shares["model forward"] + shares["HTTP busy (concurrent)"]
    return {"in_step_samples": in_step, "shares": shares, "engine_overhead": overhead, "counts": counts}


def format_table(summary: dict) -> str:
    lines = ["| part of a step | share of step time |", "|---|---|"]
    for b, v in summary["shares"].items():
        lines.append(f"| {b} | {100 * v:.1f}% |")
    lines.append(f"| **engine overhead** (all but the forward pass, plus HTTP) | **{100 * summary['engine_overhead']:.1f}%** |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        raise ValueError("py-spy is not installed: pip install py-spy")
    os.makedirs(args.results_dir, exist_ok=True)
    raw_path = os.path.join(args.results_dir, "pyspy.raw")
    with running_server(args.dtype, args.quantization, args.server_args,
                        os.path.join(args.results_dir, "server.log")) as (proc, base):
        prompts = load_prompts(args.prompts_file)[: args.num_prompts]
        reqs = [BenchRequest(p, args.output_len) for p in prompts]
        asyncio.run(run_load(load_args(base, args.concurrency), reqs[:4], show_progress=False))  # warm-up
        spy = subprocess.Popen([pyspy, "record", "--pid", str(proc.pid), "--format", "raw", "--output", raw_path,
                                "--rate", str(args.rate), "--nolineno", "--threads", "--idle", "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)
        res = asyncio.run(run_load(load_args(base, args.concurrency), reqs, show_progress=True))
        spy.send_signal(signal.SIGINT)
        _, err = spy.communicate(timeout=60)
        if not os.path.exists(raw_path):
            raise RuntimeError(f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")
    with open(raw_path) as f:
        summary = summarize(classify(parse_raw(f.read())))
    summary["load"] = {k: res[k] for k in ("output_throughput", "mean_ttft_ms", "duration_s")}
    summary["settings"] = {"concurrency": args.concurrency, "dtype": args.dtype, "quantization": args.quantization,
                           "server_args": args.server_args, "num_prompts": args.num_prompts,
                           "output_len": args.output_len}
    with open(os.path.join(args.results_dir, "overhead.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"\nconcurrency {args.concurrency}: {res['output_throughput']:.1f} output tok/s; "
          f"{summary['in_step_samples']} engine samples in steps\n")
    print(format_table(summary))
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, default=32)
    add_workload_args(p)
    add_dtype_arg(p)
    p.add_argument("--quantization", default=None)
    p.add_argument("--server-args", default="", help="extra server flags")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--results-dir", default="results/overhead")
