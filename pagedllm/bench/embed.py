"""`pagedllm bench embed`: `/v1/embeddings` throughput, pagedllm's server and peers (e.g. llama.cpp's
`llama-server --embeddings`) one at a time on the same inputs: inputs/s and prompt tokens/s per batch size (inputs
per request) at a fixed number of requests in flight, each system's peak RSS, and how closely each peer's vectors
agree with pagedllm's (mean and minimum cosine over the inputs; both sides L2-normalise, same pooling)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import httpx
import numpy as np

from pagedllm.bench.common import add_dtype_arg
from pagedllm.bench.compare import _hwm, parse_peer_cmd, running_server, started_peer
from pagedllm.bench.cpuinfo import cpu_info, cpu_line
from pagedllm.bench.offline import load_prompts


async def _measure(url: str, model: str | None, inputs: list[str], batch: int, concurrency: int) -> tuple[float, list]:
    """Seconds to embed ``inputs`` in requests of ``batch`` inputs, ``concurrency`` requests in flight; the vectors."""
    chunks = [inputs[i : i + batch] for i in range(0, len(inputs), batch)]
    vectors: list = [None] * len(chunks)
    todo = iter(range(len(chunks)))

    async def worker(client: httpx.AsyncClient) -> None:
        for i in todo:
            r = await client.post(url + "/v1/embeddings", json={"model": model, "input": chunks[i],
                                                                "encoding_format": "float"})
            r.raise_for_status()
            vectors[i] = [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]

    async with httpx.AsyncClient(timeout=600) as client:
        (await client.post(url + "/v1/embeddings", json={"model": model, "input": inputs[0]})).raise_for_status()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return time.perf_counter() - t0, [v for chunk in vectors for v in chunk]


def _rows(system: str, url: str, model: str | None, inputs: list[str], n_tokens: int, batches: list[int],
          concurrency: int) -> tuple[list[dict], np.ndarray]:
    rows, vecs = [], None
    for b in batches:
        secs, v = asyncio.run(_measure(url, model, inputs, b, concurrency))
        rows.append({"system": system, "batch": b, "concurrency": concurrency, "seconds": secs,
                     "inputs_s": len(inputs) / secs, "tokens_s": n_tokens / secs})
        vecs = np.asarray(v, dtype=np.float64)
        print(f"{system}: batch {b}: {len(inputs) / secs:.1f} inputs/s", file=sys.stderr)
    return rows, vecs


def _ready(url: str, model: str) -> bool:
    return httpx.post(url + "/v1/embeddings", timeout=60, json={"model": model, "input": "Hi"}).status_code == 200


def main(args: argparse.Namespace) -> int:
    os.makedirs(args.results_dir, exist_ok=True)
    base_prompts = load_prompts(args.prompts_file)
    inputs = [base_prompts[i % len(base_prompts)] for i in range(args.num_inputs)]
    extra = f"--no-enable-prefix-caching --pooling {args.pooling}" + (f" --model {args.model}" if args.model else "")
    with running_server(args.dtype, None, f"{extra} {args.server_args}",
                        os.path.join(args.results_dir, "server.log")) as (proc, base):
        n_tokens = sum(len(httpx.post(base + "/tokenize", json={"prompt": p}).json()["tokens"]) for p in inputs)
        rows, ours = _rows("pagedllm", base, None, inputs, n_tokens, args.batch_sizes, args.concurrency)
        rss = _hwm(proc.pid)
        for r in rows:
            r.update(peak_rss_bytes=rss, startup_s=proc.startup_s)
    ours /= np.linalg.norm(ours, axis=1, keepdims=True)
    for name, cmd in args.peer_cmd:
        log = os.path.join(args.results_dir, f"peer-{name}.log")
        with started_peer(name, cmd, log, _ready) as (proc, url, model, startup):
            prow, theirs = _rows(f"peer {name}", url, model, inputs, n_tokens, args.batch_sizes, args.concurrency)
            rss = _hwm(proc.pid)  # while it runs
        theirs /= np.linalg.norm(theirs, axis=1, keepdims=True)
        cos = (ours * theirs).sum(axis=1)
        for r in prow:
            r.update(peak_rss_bytes=rss, startup_s=startup, command=cmd,
                     cosine_mean=float(cos.mean()), cosine_min=float(cos.min()))
        rows += prow
    meta = {"cpu": cpu_info(), "num_inputs": len(inputs), "prompt_tokens": n_tokens, "pooling": args.pooling,
            "concurrency": args.concurrency, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M")}
    with open(os.path.join(args.results_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lines = [f"CPU: {cpu_line(meta['cpu'])}; {len(inputs)} inputs ({n_tokens} tokens), {args.concurrency} requests "
             f"in flight, pooling {args.pooling}", "",
             "| system | inputs per request | inputs/s | tokens/s | peak RSS MiB | start-up s | cosine to pagedllm |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        rss = f"{r['peak_rss_bytes'] / 2**20:.0f}" if r.get("peak_rss_bytes") else "?"
        cos = f"{r['cosine_mean']:.5f} (min {r['cosine_min']:.5f})" if "cosine_mean" in r else "-"
        lines.append(f"| {r['system']} | {r['batch']} | {r['inputs_s']:.1f} | {r['tokens_s']:.0f} | {rss} | "
                     f"{r['startup_s']:.1f} | {cos} |")
    table = "\n".join(lines)
    with open(os.path.join(args.results_dir, "results.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    add_dtype_arg(p)
    p.add_argument("--prompts-file", default=None, help="inputs, one JSON string per line (default: the bench prompts)")
    p.add_argument("--num-inputs", type=int, default=256)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32], help="inputs per request")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    p.add_argument("--pooling", default="last", choices=["last", "mean", "cls"])
    p.add_argument("--server-args", default="", help="extra flags for the pagedllm server")
    p.add_argument("--peer-cmd", action="append", type=parse_peer_cmd, default=[], metavar="NAME=COMMAND",
                   help="a peer this command starts ({port}: a free port), e.g. llama.cpp='llama-server -m M.gguf "
                        "--port {port} --embeddings --pooling last -t 2 -ub 2048 -b 2048'")
    p.add_argument("--results-dir", default="bench-embed")
