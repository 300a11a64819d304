"""`pagedllm bench serve`: an asynchronous streaming load generator for any OpenAI-compatible server.

It only speaks the public API (/v1/completions or /v1/chat/completions with ``stream: true``), so it measures
pagedllm, vLLM, llama.cpp's server or anything else the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

from pagedllm.bench.common import add_result_json_arg, write_json
from pagedllm.bench.metrics import RequestRecord, parse_goodput, records_to_json, summarize
from pagedllm.bench.offline import load_prompts

_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact river market energy garden window system music city story "
    "science history teacher forest engine question answer morning evening mountain ocean language computer "
    "network kitchen library animal weather planet summer winter bridge station journey letter picture"
).split()

PREFIX_SYSTEM = (
    "You are a customer support assistant for Northwind Logistics. Follow these rules strictly. Answer in at most "
    "three sentences. Always cite the policy number you rely on. Policies: (1) Parcels lost in transit are "
    "refunded in full after a 10-day investigation. (2) Damaged items may be returned free of charge within 30 "
    "days with photos of the damage. (3) Express delivery is guaranteed only for addresses inside the mainland. "
    "(4) Customs duties are paid by the recipient unless the sender chose delivered-duty-paid. (5) Address "
    "changes are possible until the parcel leaves the regional hub. (6) Perishable goods are never accepted. "
    "(7) Insurance covers up to 500 euros unless extra cover was bought. Never invent tracking numbers. "
)


@dataclass
class BenchRequest:
    prompt: str
    output_len: int


def build_dataset(args: argparse.Namespace) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    n = args.num_prompts
    if args.dataset == "file":
        prompts = load_prompts(args.dataset_path)  # None: the shipped prompt set
        if not prompts:
            raise ValueError("the dataset file has no prompts")
        return [BenchRequest(prompts[i % len(prompts)], args.output_len) for i in range(n)]
    if args.dataset == "prefix-repeat":
        # each request: one of K system prompts (K = --num-prefixes, told apart from their first words on, so they
        # share nothing) drawn at random, then its own question: users of K desks arriving in no set order
        k = getattr(args, "num_prefixes", 1)
        if k < 1:
            raise ValueError("--num-prefixes must be >= 1")
        words = getattr(args, "prefix_words", None)
        if words:  # system prompts of that many random words (about as many tokens): long shared starts
            systems = [f"Desk {d} of {k}. " + " ".join(rng.choice(_WORDS) for _ in range(words)) + ". "
                       for d in range(k)]
        else:
            systems = [PREFIX_SYSTEM] if k == 1 else [f"Desk {d} of {k}. " + PREFIX_SYSTEM for d in range(k)]
        return [BenchRequest(systems[rng.randrange(k) if k > 1 else 0] + f"Customer question {i}: "
                             + " ".join(rng.choice(_WORDS) for _ in range(12)) + "?", args.output_len)
                for i in range(n)]
    # random: lengths drawn uniformly in [len * (1 - r), len * (1 + r)]; about 1 token per word
    r = args.range_ratio
    out = []
    for _ in range(n):
        in_len = max(1, int(rng.uniform(args.input_len * (1 - r), args.input_len * (1 + r))))
        out_len = max(1, int(rng.uniform(args.output_len * (1 - r), args.output_len * (1 + r))))
        out.append(BenchRequest(" ".join(rng.choice(_WORDS) for _ in range(in_len)), out_len))
    return out


# --structured: what each request is constrained to (vLLM's structured_outputs object); the schema admits long
# outputs (an open list of strings), so constrained requests can run as long as unconstrained ones
STRUCTURED = {
    "json-schema": {"json": {"type": "object", "properties": {
        "answer": {"type": "string"}, "steps": {"type": "array", "items": {"type": "string"}}},
        "required": ["answer", "steps"]}},
    "json-object": {"json_object": True},
    "regex": {"regex": "([A-Z][a-z]+ )+[0-9]+[.]"},
    "choice": {"choice": ["yes", "no", "it depends on the weather and the time of day"]},
}


async def _one(client: httpx.AsyncClient, args, req: BenchRequest) -> RequestRecord:
    body: dict = {"model": args.model, "max_tokens": req.output_len, "temperature": args.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if getattr(args, "structured", "none") != "none":
        body["structured_outputs"] = STRUCTURED[args.structured]
    body.update(getattr(args, "extra_body", None) or {})
    if args.endpoint == "chat":
        url = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        url = "/v1/completions"
        body["prompt"] = req.prompt
    rec = RequestRecord(success=False)
    chunks = 0
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = str(obj["error"])
                    return rec
                if obj.get("usage"):
                    rec.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                    rec.output_tokens = obj["usage"].get("completion_tokens", 0)
                for ch in obj.get("choices", []):
                    text = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if chunks == 0:
                            rec.ttft = now - t0
                        else:
                            rec.itl.append(now - last)
                        last = now
                        chunks += 1
        rec.latency = last - t0 if chunks else time.perf_counter() - t0
        if not rec.output_tokens:
            rec.output_tokens = chunks  # a server without usage in streams: one token per chunk
        rec.success = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def run_load(args: argparse.Namespace, requests: list[BenchRequest], show_progress: bool = True) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = None
    if show_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="bench serve", unit="req", dynamic_ncols=True)

    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=httpx.Timeout(None),
                                 limits=limits) as client:
        if args.model is None:
            models = (await client.get("/v1/models")).json()
            args.model = models["data"][0]["id"]

        async def limited(req):
            if sem is None:
                rec = await _one(client, args, req)
            else:
                async with sem:
                    rec = await _one(client, args, req)
            if bar is not None:
                bar.update(1)
            return rec

        tasks = []
        start = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.ensure_future(limited(req)))
            if args.request_rate != float("inf"):
                # gamma-distributed gaps: burstiness 1 = Poisson; lower = burstier
                theta = 1.0 / (args.request_rate * args.burstiness)
                await asyncio.sleep(rng.gammavariate(args.burstiness, theta))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    result = summarize(records, duration, parse_goodput(args.goodput))
    result.update({"base_url": args.base_url, "endpoint": args.endpoint, "model": args.model,
                   "num_prompts": len(requests), "request_rate": str(args.request_rate),
                   "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "dataset": args.dataset})
    result["requests"] = records_to_json(records)
    return result


def prefix_cache_counts(urls: list[str]) -> tuple[float, float] | None:
    """Prompt tokens looked up in the prefix cache and found there, summed over the servers' /metrics (vLLM's
    names); None when one of them does not export them."""
    queries = hits = 0.0
    for url in urls:
        try:
            text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return None
        found = False
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name == "vllm:prefix_cache_queries_total":
                queries += float(line.rsplit(" ", 1)[1])
                found = True
            elif name == "vllm:prefix_cache_hits_total":
                hits += float(line.rsplit(" ", 1)[1])
        if not found:
            return None
    return queries, hits


def print_summary(r: dict) -> None:
    rows = [
        ("Successful requests", f"{r['completed']}"), ("Failed requests", f"{r['failed']}"),
        ("Benchmark duration (s)", f"{r['duration_s']:.2f}"),
        ("Total input tokens", f"{r['total_input_tokens']}"), ("Total generated tokens", f"{r['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{r['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{r['total_token_throughput']:.2f}"),
    ]
    if "goodput" in r:
        rows.append(("Goodput (req/s)", f"{r['goodput']:.2f}"))
    if "prefix_cache_hit_rate" in r:
        rows.append(("Prefix-cache hit rate", f"{r['prefix_cache_hit_rate']:.1%}"))
    for key, label in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"-- {label} --", ""))
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {key.upper()} (ms)", f"{r[f'{stat}_{key}_ms']:.2f}"))
    width = max(len(a) for a, _ in rows) + 2
    print("=" * (width + 12))
    print(" Serving Benchmark Result ".center(width + 12, "="))
    for a, b in rows:
        print(f"{a:<{width}}{b:>12}")
    print("=" * (width + 12))
    if r.get("errors"):
        print("first errors:", *r["errors"][:3], sep="\n  ")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--dataset", choices=["random", "file", "prefix-repeat"], default="random")
    p.add_argument("--dataset-path", default=None, help="JSONL with a 'prompt' field (file dataset)")
    p.add_argument("--num-prefixes", type=int, default=1,
                   help="prefix-repeat: this many distinct system prompts, each request using one drawn at random")
    p.add_argument("--prefix-words", type=int, default=None,
                   help="prefix-repeat: system prompts of this many random words instead of the shipped one")
    p.add_argument("--metrics-url", action="append", default=None,
                   help="servers whose /metrics give the prefix-cache hit rate of the run (repeatable; default: "
                        "--base-url; behind a router, name the replicas)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--extra-body", type=json.loads, default=None,
                   help="JSON merged into every request body (server-specific fields)")
    p.add_argument("--structured", choices=["none", *STRUCTURED], default="none",
                   help="constrain every request (structured_outputs): throughput with vs without constraints")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs: ttft:MS tpot:MS e2el:MS")
    add_result_json_arg(p)
    p.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    if args.burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be > 0")
    requests = build_dataset(args)
    metrics_urls = args.metrics_url or [args.base_url]
    before = prefix_cache_counts(metrics_urls)
    result = asyncio.run(run_load(args, requests, show_progress=not args.no_progress))
    after = prefix_cache_counts(metrics_urls)
    if before is not None and after is not None and after[0] > before[0]:
        result["prefix_cache_hit_rate"] = (after[1] - before[1]) / (after[0] - before[0])
    print_summary(result)
    write_json(args.result_json, result)
    return 0 if result["completed"] else 1
