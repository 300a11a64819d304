"""`pagedllm bench embed`: `/v1/embeddings` throughput, pagedllm's server, sentence-transformers' ``encode`` (in this
process, on the same model folder) and peers (e.g. llama.cpp's `llama-server --embeddings`), one at a time on the
same inputs (by default the 200 documents of the shipped retrieval set): inputs/s and prompt tokens/s per batch
size (inputs per request) at a fixed number of requests in flight, latency percentiles, each server's peak RSS, how
closely each peer's vectors agree with pagedllm's (mean and minimum cosine; both L2-normalised), and each one's
top-1 recall on the retrieval set (40 queries; the model's query / document prompts where it declares them)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from importlib import resources

import aiohttp
import httpx
import numpy as np

from pagedllm.bench.common import add_dtype_arg
from pagedllm.bench.compare import _hwm, parse_peer_cmd, running_server, started_peer
from pagedllm.bench.cpuinfo import cpu_info, cpu_line
from pagedllm.bench.offline import load_prompts
from pagedllm.model.sentence import read_sentence_modules


async def _measure(url: str, model: str | None, inputs: list[str], batch: int, concurrency: int,
                   extra: dict | None = None) -> tuple[float, list, list[float]]:
    """Seconds to embed ``inputs`` in requests of ``batch`` inputs, ``concurrency`` requests in flight; the vectors
    and each request's latency."""
    chunks = [inputs[i : i + batch] for i in range(0, len(inputs), batch)]
    vectors: list = [None] * len(chunks)
    latencies: list[float] = []
    todo = iter(range(len(chunks)))

    async def worker(client: aiohttp.ClientSession) -> None:
        for i in todo:
            t = time.perf_counter()
            async with client.post(url + "/v1/embeddings", json={"model": model, "input": chunks[i],
                                                                  "encoding_format": "float", **(extra or {})}) as r:
                r.raise_for_status()
                body = await r.json()
            latencies.append(time.perf_counter() - t)
            vectors[i] = [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]

    # aiohttp, not httpx: the client shares the machine with the server, and httpx's ~1.1 ms of CPU per request
    # (against aiohttp's ~0.4) took a fifth of a core from a small model's server at 32 in flight
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 4),
                                     timeout=aiohttp.ClientTimeout(total=600)) as client:
        async with client.post(url + "/v1/embeddings", json={"model": model, "input": inputs[0]}) as r:
            r.raise_for_status()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return time.perf_counter() - t0, [v for chunk in vectors for v in chunk], latencies


def _row(system: str, batch: int, concurrency: int, secs: float, n_inputs: int, n_tokens: int,
         latencies: list[float] | None) -> dict:
    row = {"system": system, "batch": batch, "concurrency": concurrency, "seconds": secs,
           "inputs_s": n_inputs / secs, "tokens_s": n_tokens / secs}
    if latencies:
        lat = np.sort(np.asarray(latencies))
        row.update(p50_latency_s=float(np.percentile(lat, 50)), p99_latency_s=float(np.percentile(lat, 99)))
    return row


def _rows(system: str, url: str, model: str | None, inputs: list[str], n_tokens: int, batches: list[int],
          concurrency: int) -> tuple[list[dict], np.ndarray]:
    rows, vecs = [], None
    for b in batches:
        secs, v, lat = asyncio.run(_measure(url, model, inputs, b, concurrency))
        rows.append(_row(system, b, concurrency, secs, len(inputs), n_tokens, lat))
        vecs = np.asarray(v, dtype=np.float64)
        print(f"{system}: batch {b}: {len(inputs) / secs:.1f} inputs/s", file=sys.stderr)
    return rows, vecs


def _ready(url: str, model: str) -> bool:
    return httpx.post(url + "/v1/embeddings", timeout=60, json={"model": model, "input": "Hi"}).status_code == 200


def load_embed_texts(path: str | None = None) -> tuple[list[dict], list[dict]]:
    """The shipped retrieval set (``data/embed_texts.jsonl``): 200 documents (64-256-token passages of the Python
    reference's topics) and 40 queries, each with the topic it asks about."""
    text = (resources.files("pagedllm.bench").joinpath("data/embed_texts.jsonl").read_text() if path is None
            else open(path).read())
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in rows if r["kind"] == "document"], [r for r in rows if r["kind"] == "query"]


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def top1_recall(docs: list[dict], doc_vecs: np.ndarray, queries: list[dict], query_vecs: np.ndarray) -> float:
    """The share of queries whose most similar document (cosine) is about the query's topic."""
    best = (_unit(query_vecs) @ _unit(doc_vecs).T).argmax(axis=1)
    return float(np.mean([docs[j]["topic"] == q["topic"] for j, q in zip(best, queries)]))


def _prompt_names(model: str | None) -> tuple[str | None, str | None]:
    """The model's query and document prompt names, where its folder declares them (EmbeddingGemma)."""
    st = read_sentence_modules(model) if model else None
    prompts = st.prompts if st is not None else {}
    return ("query" if "query" in prompts else None), ("document" if "document" in prompts else None)


def _sentence_transformers(model: str, inputs: list[str], batches: list[int], n_tokens: int, docs: list[dict],
                           queries: list[dict]) -> tuple[list[dict], np.ndarray, float]:
    """sentence-transformers' ``encode`` in this process (float32, as the model ships) at each batch size: rows,
    the vectors of ``inputs``, and its top-1 recall on the retrieval set."""
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(os.cpu_count() or 1)
    st = SentenceTransformer(model, device="cpu")
    q_name, d_name = _prompt_names(model)
    rows, vecs = [], None
    st.encode(inputs[:8])
    for b in batches:
        t = time.perf_counter()
        vecs = st.encode(inputs, batch_size=b, convert_to_numpy=True)
        rows.append(_row("sentence-transformers", b, 1, time.perf_counter() - t, len(inputs), n_tokens, None))
        print(f"sentence-transformers: batch {b}: {rows[-1]['inputs_s']:.1f} inputs/s", file=sys.stderr)
    recall = top1_recall(docs, st.encode([d["text"] for d in docs], prompt_name=d_name), queries,
                         st.encode([q["text"] for q in queries], prompt_name=q_name))
    return rows, np.asarray(vecs, dtype=np.float64), recall


def main(args: argparse.Namespace) -> int:
    os.makedirs(args.results_dir, exist_ok=True)
    docs, queries = load_embed_texts()
    base_prompts = load_prompts(args.prompts_file) if args.prompts_file else [d["text"] for d in docs]
    n_inputs = args.num_inputs or (256 if args.prompts_file else len(base_prompts))
    inputs = [base_prompts[i % len(base_prompts)] for i in range(n_inputs)]
    extra = "--no-enable-prefix-caching" + (f" --pooling {args.pooling}" if args.pooling else "") + (
        f" --model {args.model}" if args.model else "")
    q_name, d_name = _prompt_names(args.model)
    recall = {}
    with running_server(args.dtype, None, f"{extra} {args.server_args}",
                        os.path.join(args.results_dir, "server.log")) as (proc, base):
        n_tokens = sum(len(httpx.post(base + "/tokenize", json={"prompt": p}).json()["tokens"]) for p in inputs)
        rows, ours = _rows("pagedllm", base, None, inputs, n_tokens, args.batch_sizes, args.concurrency)
        rss = _hwm(proc.pid)
        for r in rows:
            r.update(peak_rss_bytes=rss, startup_s=proc.startup_s)
        d_vecs = asyncio.run(_measure(base, None, [d["text"] for d in docs], 32, 1, {"prompt_name": d_name}))[1]
        q_vecs = asyncio.run(_measure(base, None, [q["text"] for q in queries], 32, 1, {"prompt_name": q_name}))[1]
        recall["pagedllm"] = top1_recall(docs, np.asarray(d_vecs), queries, np.asarray(q_vecs))
    ours = _unit(ours)
    peers = []
    if args.sentence_transformers:
        st_rows, st_vecs, recall["sentence-transformers"] = _sentence_transformers(
            args.model, inputs, args.st_batch_sizes, n_tokens, docs, queries)
        peers.append((st_rows, st_vecs))
    for name, cmd in args.peer_cmd:
        log = os.path.join(args.results_dir, f"peer-{name}.log")
        with started_peer(name, cmd, log, _ready) as (proc, url, model, startup):
            prow, theirs = _rows(f"peer {name}", url, model, inputs, n_tokens, args.batch_sizes, args.concurrency)
            rss = _hwm(proc.pid)  # while it runs
        for r in prow:
            r.update(peak_rss_bytes=rss, startup_s=startup, command=cmd)
        peers.append((prow, theirs))
    for prow, theirs in peers:
        cos = (ours * _unit(theirs)).sum(axis=1)
        for r in prow:
            r.update(cosine_mean=float(cos.mean()), cosine_min=float(cos.min()))
        rows += prow
    meta = {"cpu": cpu_info(), "num_inputs": len(inputs), "prompt_tokens": n_tokens, "pooling": args.pooling,
            "model": args.model, "concurrency": args.concurrency, "top1_recall": recall,
            "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M")}
    with open(os.path.join(args.results_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lines = [f"CPU: {cpu_line(meta['cpu'])}; {len(inputs)} inputs ({n_tokens} tokens)", "",
             "| system | inputs per request | requests in flight | inputs/s | tokens/s | p50 / p99 latency s | "
             "peak RSS MiB | start-up s | cosine to pagedllm |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rss = f"{r['peak_rss_bytes'] / 2**20:.0f}" if r.get("peak_rss_bytes") else "-"
        cos = f"{r['cosine_mean']:.6f} (min {r['cosine_min']:.6f})" if "cosine_mean" in r else "-"
        lat = f"{r['p50_latency_s']:.3f} / {r['p99_latency_s']:.3f}" if "p99_latency_s" in r else "-"
        up = f"{r['startup_s']:.1f}" if "startup_s" in r else "-"
        lines.append(f"| {r['system']} | {r['batch']} | {r['concurrency']} | {r['inputs_s']:.1f} | {r['tokens_s']:.0f} "
                     f"| {lat} | {rss} | {up} | {cos} |")
    lines += ["", "Top-1 recall on the shipped retrieval set (40 queries, 200 documents): " + ", ".join(
        f"{k} {v:.3f}" for k, v in recall.items())]
    table = "\n".join(lines)
    with open(os.path.join(args.results_dir, "results.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="an embedding model's folder (e.g. `pagedllm fetch all-minilm-l6-v2`), or a "
                   ".gguf file (default: the embedded SmolLM2)")
    add_dtype_arg(p)
    p.add_argument("--prompts-file", default=None, help="inputs, one JSON object with a prompt per line (default: the 200 "
                   "documents of the shipped retrieval set)")
    p.add_argument("--num-inputs", type=int, default=None, help="inputs, the prompts cycled (default: 256 from "
                   "--prompts-file, else the 200 shipped documents once; more: a longer, steadier run)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1], help="inputs per request")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--pooling", default=None, choices=["last", "mean", "cls"],
                   help="the server's pooling (default: the model's own, else the last token's)")
    p.add_argument("--sentence-transformers", action="store_true",
                   help="also sentence-transformers' encode on the same model folder, in this process, after the server")
    p.add_argument("--st-batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--server-args", default="", help="extra flags for the pagedllm server")
    p.add_argument("--peer-cmd", action="append", type=parse_peer_cmd, default=[], metavar="NAME=COMMAND",
                   help="a peer this command starts ({port}: a free port), e.g. llama.cpp='llama-server -m M.gguf "
                        "--port {port} --embeddings --pooling last -t 2 -ub 2048 -b 2048'")
    p.add_argument("--results-dir", default="bench-embed")
