"""`python -m tools.ladder`: the optimization ladder, measured on this machine in one run.

Each row is one cumulative step from a naive deployment to the optimized one:

1. naive: HuggingFace transformers, float32, one request at a time (``bench compare``'s HF baseline);
2. + paged KV cache and continuous batching: the pagedllm server, ``--dtype float32``, prefix caching off;
3. + 4-bit weights: ``--dtype auto`` (on CPU the GGUF file's Q4 blocks through the block kernel when the start-up
   measurement picks them; ``/health``'s runtime says what ran), prefix caching off;
4. + prefix caching (on);
5. + speculative decoding (n-gram drafts; ``--spec-config``).

Every step runs the same three workloads, so every cell compares like with like: W1 (the shipped prompts),
shared-prefix (the same prompts after one shared ~420-token system prompt: what prefix caching is for) and
code-rewrite (prompts whose answer repeats a code snippet with one change: what n-gram drafting is for). Each step
has a target workload (W1 for steps 1-3, shared-prefix for 4, code-rewrite for 5) on which its latency, TTFT and
memory are reported and its speedup over step 1 is computed. Server steps are measured by ``bench serve``'s client
(streaming ``/v1/completions``, greedy, EOS ignored and masked, fixed concurrency); step 1 receives the same burst
and serves it one request at a time. Step 1 runs the two extra workloads on their first ``--hf-subset-prompts``
prompts only (one-at-a-time throughput does not depend on how many requests queue; the full sets would take
~10 more minutes on a 2-core machine).

Quality gates (a failed gate is shown as FAILED, never dropped):
- step 2: greedy output identical to step 1 (HF) on the first prompts of the shared-prefix and code-rewrite sets;
- step 3: ``pagedllm eval --candidate default --candidate-dtype auto`` against float32 (perplexity, business-set
  accuracy, top-1 agreement; its own thresholds);
- steps 4 and 5: greedy output identical to step 3 on the same prompts (prefix caching and greedy speculative
  decoding must not change a token).
Outputs for the gates come from a separate greedy pass (non-streaming, ``--gate-prompts`` prompts per workload)
after each measured run on the same server. Writes results.json, results.md and chart.png into ``--results-dir``
(the gates, the tables and the chart are built by ``report.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import resources

import httpx

from pagedllm.bench.common import add_result_json_arg, add_workload_args
from pagedllm.bench.compare import _hwm, _load_row, _peak_rss, _run_phase, _scrape, load_args, running_server
from pagedllm.bench.cpuinfo import cpu_info, cpu_line
from tools.ladder.report import GATE_WORKLOADS, TITLES, WORKLOADS, compute_gates, write_outputs
from pagedllm.bench.offline import load_prompts, run_hf_one_at_a_time
from pagedllm.bench.serve import BenchRequest, run_load
from pagedllm.config import SpeculativeConfig, default_model_path
from pagedllm.engine.tokenizer import load_tokenizer
from pagedllm.model.fetch import fetched_path

# ~420 tokens with the model's tokenizer (tests check the range); shared verbatim by every shared-prefix prompt
SHARED_SYSTEM = (
    "You are the writing assistant of Harbourline, a small publishing and consulting company. Every answer you "
    "write follows the house style guide below, whatever the request is about.\n"
    "1. Audience. Write for a busy, intelligent reader who is not a specialist. Explain a technical term the first "
    "time you use it, in plain words, and do not use it again if a simpler word will do.\n"
    "2. Structure. Start with the answer or the main recommendation in one or two sentences. Then give the "
    "reasons or the steps, in the order the reader will need them. End with what the reader should do next.\n"
    "3. Length. Prefer short paragraphs of two to four sentences. Use a numbered list for steps that must happen "
    "in order and a bulleted list for options that do not. Never pad an answer to make it look thorough.\n"
    "4. Tone. Be warm but direct. Do not flatter the reader, do not apologise for things that are not your fault, "
    "and do not use exclamation marks. Avoid marketing language such as 'world-class' or 'cutting-edge'.\n"
    "5. Accuracy. If you are not sure about a fact, say so and say how the reader can check it. Never invent "
    "names, prices, dates, statistics, quotations or references. Give ranges rather than false precision.\n"
    "6. Safety. For anything involving health, money, law or physical risk, give general information only and "
    "recommend a qualified professional for decisions. Point out the most common mistake people make.\n"
    "7. Language. Use British spelling, the active voice and concrete verbs. Write numbers from one to nine in "
    "words and larger numbers in digits. Use the 24-hour clock and write dates as 3 March 2025.\n"
    "8. Formatting. Use headings only for long answers. Put commands, file names and code in backticks.\n"
    "9. Closing. Finish with a single sentence that summarises the key point. Do not add a sign-off, a signature or "
    "an offer of further help.\n\n"
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout (tools/ beside)
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


# ---------------------------------------------------------------------- workloads
def shared_prefix_prompt(prompt: str) -> str:
    return f"{SHARED_SYSTEM}Request: {prompt}"


def code_rewrite_prompts() -> list[str]:
    """The shipped code-rewrite set (``data/code_rewrite.jsonl``): 8 snippets x 5 one-line changes, ordered so
    that every run of 8 consecutive prompts covers all 8 snippets with different changes."""
    text = resources.files("pagedllm.bench").joinpath("data/code_rewrite.jsonl").read_text()
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def _cycle(prompts: list[str], n: int) -> list[str]:
    return [prompts[i % len(prompts)] for i in range(n)]


def build_workloads(num_prompts: int) -> dict[str, list[str]]:
    """The three workloads, ``num_prompts`` each (the sets repeat beyond their length: 40 prompts each)."""

    w1 = _cycle(load_prompts(None), num_prompts)
    return {"w1": w1, "prefix": [shared_prefix_prompt(p) for p in w1],
            "code": _cycle(code_rewrite_prompts(), num_prompts)}


def single_stream_prompts(n: int) -> list[str]:
    """The last ``n`` code-rewrite prompts: with the default 32 measured prompts they are not in the concurrent
    run, so prefix caching cannot serve them from that run's blocks."""
    code = code_rewrite_prompts()
    return code[len(code) - n:] if n else []


# ---------------------------------------------------------------------- steps
@dataclass(frozen=True)
class Step:
    number: int
    title: str
    target: str  # the workload this step is for
    dtype: str | None = None  # None: the HF baseline (no server)
    extra: tuple[str, ...] = ()  # more server flags (no whitespace inside one flag: compare.running_server splits)

    @property
    def flags(self) -> str:
        if self.dtype is None:
            return "transformers generate(), batch 1"
        return " ".join([f"--dtype {self.dtype}", *(shlex.quote(x) for x in self.extra)])


def ladder_steps(spec_config: dict | None = None) -> list[Step]:
    spec = json.dumps(spec_config or NGRAM_CONFIG, separators=(",", ":"))
    return [
        Step(1, "naive: HF transformers float32, one request at a time", "w1"),
        Step(2, "paged KV cache + continuous batching (float32)", "w1", "float32", ("--no-enable-prefix-caching",)),
        Step(3, "+ 4-bit weights (engine default on CPU)", "w1", "auto", ("--no-enable-prefix-caching",)),
        Step(4, "+ prefix caching", "prefix", "auto", ()),
        Step(5, "+ speculative decoding (n-gram)", "code", "auto", ("--speculative-config", spec)),
    ]


# ---------------------------------------------------------------------- measuring
def _log(msg: str) -> None:
    print(f"[ladder {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def _measure(base: str, concurrency: int, prompts: list[str], output_len: int,
                   show_progress: bool) -> tuple[dict, float]:
    """One `bench serve` run (greedy, EOS ignored and masked) while polling the KV usage: (result, peak usage)."""

    args = load_args(base, concurrency)
    args.ignore_eos = False  # ignore_eos would let EOS be generated (and skipped); min_tokens masks it instead,
    args.extra_body = {"min_tokens": output_len}  # as HF's min_new_tokens does: the same greedy tokens
    peak = 0.0
    stop = asyncio.Event()

    async def watch():
        nonlocal peak
        async with httpx.AsyncClient(base_url=base) as h:
            while not stop.is_set():
                try:
                    for line in (await h.get("/metrics", timeout=5)).text.splitlines():
                        if line.startswith("pagedllm:kv_cache_usage_perc{"):
                            peak = max(peak, float(line.rsplit(" ", 1)[1]))
                except httpx.HTTPError:
                    pass
                try:
                    await asyncio.wait_for(stop.wait(), 0.2)
                except asyncio.TimeoutError:
                    pass

    w = asyncio.ensure_future(watch())
    try:
        res = await run_load(args, [BenchRequest(p, output_len) for p in prompts], show_progress=show_progress)
    finally:
        stop.set()
        await w
    return res, peak


async def _greedy_texts(base: str, prompts: list[str], output_len: int, concurrency: int) -> list[str]:
    """Greedy completions (non-streaming, EOS masked) of ``prompts``: the outputs the gates compare."""

    sem = asyncio.Semaphore(max(concurrency, 1))
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(None)) as h:
        model = (await h.get("/v1/models")).json()["data"][0]["id"]

        async def one(p: str) -> str:
            async with sem:
                r = await h.post("/v1/completions", json={
                    "model": model, "prompt": p, "max_tokens": output_len, "min_tokens": output_len,
                    "temperature": 0.0})  # min_tokens masks EOS as HF's min_new_tokens does (ignore_eos would
                #                           let EOS be generated and skipped, then the texts differ from HF's)
                r.raise_for_status()
                return r.json()["choices"][0]["text"]

        return list(await asyncio.gather(*(one(p) for p in prompts)))


_WEIGHTS_RE = re.compile(r"model .* weights .* \(([\d.]+) MiB\), .*; KV cache \d+ blocks")


def weights_bytes_from_log(text: str) -> int | None:
    """Weight bytes from the model runner's start-up line ("..., weights gguf (90.5 MiB), ...; KV cache ...")."""
    m = _WEIGHTS_RE.search(text)
    return int(float(m.group(1)) * 2**20) if m else None


def _counter(m: dict, name: str) -> float:
    return m.get(f"pagedllm:{name}_total", m.get(f"pagedllm:{name}", 0.0))


def counter_deltas(before: dict, after: dict) -> dict:
    """Prefix-cache hit rate and speculative acceptance over one run, from two `/metrics` scrapes."""
    d = {k: _counter(after, k) - _counter(before, k) for k in (
        "prefix_cache_queries", "prefix_cache_hits", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens")}
    out: dict = {}
    if d["prefix_cache_queries"] > 0:
        out["prefix_cache_hit_rate"] = d["prefix_cache_hits"] / d["prefix_cache_queries"]
    if d["spec_decode_num_drafts"] > 0:
        out["spec_mean_acceptance_length"] = 1 + d["spec_decode_num_accepted_tokens"] / d["spec_decode_num_drafts"]
        out["spec_acceptance_rate"] = d["spec_decode_num_accepted_tokens"] / max(d["spec_decode_num_draft_tokens"], 1)
    return out


def run_server_step(step: Step, workloads: dict[str, list[str]], single: list[str], args,
                    results_dir: str) -> dict:

    row = _new_row(step)
    log_path = os.path.join(results_dir, f"server_step{step.number}.log")
    L, C = args.output_len, args.concurrency
    progress = not getattr(args, "no_progress", False)
    with running_server(step.dtype, None, " ".join(step.extra), log_path) as (proc, base):
        asyncio.run(_greedy_texts(base, ["Hello, my name is"], 4, 1))  # warm-up, shares no prefix with any set
        row["runtime"] = httpx.get(base + "/health", timeout=10).json().get("runtime")
        m = _scrape(base)
        capacity = m.get("pagedllm:kv_cache_capacity_bytes", 0.0)
        bytes_per_token = capacity / max(m.get("pagedllm:kv_cache_capacity_tokens", 0.0), 1.0)
        max_len = httpx.get(base + "/v1/models", timeout=10).json()["data"][0].get("max_model_len", 0)
        row["kv_capacity_bytes"] = capacity
        if single:  # first: nothing of the sets is cached yet
            _log(f"step {step.number}: code rewrite, one stream, {len(single)} prompts")
            res, _ = asyncio.run(_measure(base, 1, single, L, progress))
            row["single_stream"] = {"output_tok_s": res["output_throughput"], "num_prompts": len(single),
                                    "failed": res["failed"]}
        for key in WORKLOADS:
            _log(f"step {step.number}: {TITLES[key]}, {len(workloads[key])} prompts at concurrency {C}")
            before = _scrape(base)
            res, peak = asyncio.run(_measure(base, C, workloads[key], L, progress))
            time.sleep(0.3)  # the engine records a step's stats just after delivering its outputs
            w = _load_row(f"step {step.number} {key}", res, num_prompts=len(workloads[key]),
                          kv_bytes_used_peak=peak * capacity,
                          kv_bytes_static_max_len=min(C, len(workloads[key])) * max_len * bytes_per_token,
                          **counter_deltas(before, _scrape(base)))
            if res["failed"]:
                w["errors"] = res.get("errors", [])[:3]
            row["workloads"][key] = w
            if key in GATE_WORKLOADS and args.gate_prompts:
                row["texts"][key] = asyncio.run(_greedy_texts(base, workloads[key][: args.gate_prompts], L,
                                                              min(C, args.gate_prompts)))
        row["peak_rss_bytes"] = _hwm(proc.pid)
    with open(log_path) as f:
        row["weights_bytes"] = weights_bytes_from_log(f.read())
    return row


def resolve_draft_pair(value: str | None, enabled: bool = True) -> tuple[str, str] | None:
    """Step 5's draft-model variant: ``TARGET,DRAFT`` paths, or (no value) the Qwen2.5-Coder 1.5B target and 0.5B
    draft when both have been fetched (`pagedllm fetch`); None: no draft-model row."""
    if not enabled:
        return None
    if value:
        parts = value.split(",")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"--draft-pair must be TARGET,DRAFT (two model paths), got {value!r}")
        for path in parts:
            if path != "default" and not os.path.exists(path):
                raise ValueError(f"--draft-pair: {path} does not exist")
        return parts[0], parts[1]
    target, draft = fetched_path("qwen2.5-coder-1.5b"), fetched_path("qwen2.5-coder-0.5b")
    return (target, draft) if target and draft else None


def run_draft_step(target: str, draft: str, output_len: int, results_dir: str, dtype: str = "auto") -> dict:
    """Step 5 with a draft model: `bench spec` on the pair's target, one code-rewrite stream at a time, without
    speculation, with n-gram and with the draft model; its gate is greedy identity with the run without."""
    out = os.path.join(results_dir, "draft_step.json")
    cmd = [sys.executable, "-m", "pagedllm.cli.main", "bench", "spec", "--model", target, "--draft-model", draft,
           "--dtype", dtype, "--skip-concurrency", "--output-len", str(output_len), "--max-model-len", "2048",
           "--result-json", out]  # the Qwen models' 32k context would not fit the default KV budget: 2k does
    _log("step 5, draft model: " + shlex.join(["pagedllm", *cmd[3:]]))
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        rows = json.load(f)["single"]
    bad = [r["config"] for r in rows if not r["greedy_identical"]]
    gate = ({"status": "FAILED", "detail": f"greedy output differs from no speculation: {', '.join(bad)}"} if bad
            else {"status": "PASS", "detail": "greedy output identical to the target alone"})
    return {"target": os.path.basename(target), "draft": os.path.basename(draft), "dtype": dtype,
            "output_len": output_len, "rows": rows, "gate": gate, "seconds": round(time.perf_counter() - t0, 1),
            "command": "pagedllm " + shlex.join(cmd[3:])}


def _run_ladder_phase(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "tools.ladder", *argv], stdout=subprocess.PIPE, text=True,
                         check=True, cwd=ROOT)  # stderr (progress bars) passes through
    return json.loads(out.stdout.strip().splitlines()[-1])


def _write_prompts(path: str, prompts: list[str]) -> str:
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    return path


def run_hf_step(step: Step, workloads: dict[str, list[str]], args, results_dir: str) -> dict:
    """Step 1: `bench compare`'s HF phase (one at a time, latencies from a burst at t=0) on W1; `bench offline`'s
    HF loop (which keeps the token ids, for step 2's gate) on the first prompts of the other two workloads."""

    row = _new_row(step)
    L = args.output_len
    paths = {k: _write_prompts(os.path.join(results_dir, f"prompts_{k}.jsonl"), workloads[k]) for k in WORKLOADS}
    _log(f"step 1: {TITLES['w1']}, {len(workloads['w1'])} prompts, one at a time")
    w = _run_phase(["--phase", "hf", "--batch-size", "1", "--dtype", "float32", "--num-prompts",
                    str(len(workloads["w1"])), "--output-len", str(L), "--prompts-file", paths["w1"]])
    w["num_prompts"] = len(workloads["w1"])
    row["workloads"]["w1"] = w
    rss = [w.get("peak_rss_bytes") or 0]
    n = min(args.hf_subset_prompts, len(workloads["w1"]))
    tok = load_tokenizer(default_model_path()) if n else None
    for key in ("prefix", "code"):
        if not n:
            break
        _log(f"step 1: {TITLES[key]}, first {n} prompts, one at a time")
        r = _run_ladder_phase(["--phase", "hf-ids", "--prompts-file", paths[key], "--num-prompts", str(n),
                               "--output-len", str(L)])
        row["workloads"][key] = {"output_tok_s": r["output_tok_s"], "output_tokens": r["output_tokens"],
                                 "duration_s": r["seconds"], "num_prompts": n, "subset": True, "failed": 0}
        row["texts"][key] = [tok.decode(ids, skip_special_tokens=True) for ids in r["token_ids"]]
        rss.append(r.get("peak_rss_bytes") or 0)
    row["peak_rss_bytes"] = max(rss) or None
    return row


def run_eval(args, results_dir: str) -> dict:
    """`pagedllm eval` of step 3's weights (the engine default, --dtype auto) against float32, in its own
    process (it loads two models); exit status 1 = the gate failed."""
    path = os.path.join(results_dir, "eval.json")
    cmd = [sys.executable, "-m", "pagedllm.cli.main", "eval", "--candidate", "default", "--candidate-dtype", "auto",
           "--json", path, *shlex.split(args.eval_args)]
    _log("step 3 gate: " + shlex.join(["pagedllm", *cmd[3:]]))
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    print(r.stdout, file=sys.stderr)
    if r.returncode not in (0, 1) or not os.path.exists(path):
        return {"error": f"pagedllm eval exited with status {r.returncode}", "command": shlex.join(cmd[3:])}
    with open(path) as f:
        res = json.load(f)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["command"] = "pagedllm " + shlex.join(cmd[3:])
    return res


def _new_row(step: Step) -> dict:
    return {"step": step.number, "title": step.title, "target": step.target, "flags": step.flags,
            "workloads": {}, "texts": {}, "single_stream": None, "runtime": None, "weights_bytes": None,
            "kv_capacity_bytes": None, "peak_rss_bytes": None, "error": None}


# ---------------------------------------------------------------------- command
def selected_steps(args) -> list[int]:
    steps = sorted(set(args.steps))
    if args.skip_hf and 1 in steps:
        steps.remove(1)
    return steps


def main(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.output_len < 1 or args.concurrency < 1:
        raise ValueError("--num-prompts, --output-len and --concurrency must be >= 1")
    SpeculativeConfig.from_dict(args.spec_config)  # a bad --spec-config stops here, before anything runs
    if any(c.isspace() for c in json.dumps(args.spec_config, separators=(",", ":"))):
        raise ValueError("--spec-config values must not contain whitespace")
    steps = selected_steps(args)
    if not steps:
        raise ValueError("no steps left to run")
    os.makedirs(args.results_dir, exist_ok=True)
    t_start = time.perf_counter()
    workloads = build_workloads(args.num_prompts)
    single = single_stream_prompts(args.single_stream_prompts)
    tok = load_tokenizer(default_model_path())
    descriptions = {"w1": "the shipped prompts, `pagedllm/bench/data/prompts.jsonl`",
                    "prefix": f"the same prompts after one shared system prompt of "
                              f"{len(tok.encode(SHARED_SYSTEM))} tokens",
                    "code": "rewrite a 19-23 line Python snippet with one change, "
                            "`pagedllm/bench/data/code_rewrite.jsonl`"}
    meta = {"command": "pagedllm " + shlex.join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M"),
            "cpu": cpu_line(cpu_info()), "cpus": os.cpu_count(), "num_prompts": args.num_prompts,
            "output_len": args.output_len, "concurrency": args.concurrency, "steps": steps,
            "gate_prompts": min(args.gate_prompts, args.num_prompts),
            "hf_subset_prompts": min(args.hf_subset_prompts, args.num_prompts),
            "single_stream_prompts": len(single), "spec_config": args.spec_config, "workloads": {}, "notes": []}
    for k in WORKLOADS:
        lens = [len(tok.encode(p)) for p in workloads[k]]
        meta["workloads"][k] = {"num_prompts": len(lens), "prompt_tokens_min": min(lens),
                                "prompt_tokens_max": max(lens), "description": descriptions[k]}
    pair = resolve_draft_pair(args.draft_pair, not args.no_draft) if 5 in steps else None
    if pair is None and 5 in steps and not args.no_draft:
        meta["notes"].append("Step 5 ran n-gram drafting only: no draft model shares SmolLM2-135M's tokenizer, and "
                             "the Qwen2.5-Coder pair was not fetched (`pagedllm fetch qwen2.5-coder-1.5b` and "
                             "`qwen2.5-coder-0.5b` add a draft-model table, or give --draft-pair TARGET,DRAFT).")
    by_number = {s.number: s for s in ladder_steps(args.spec_config)}
    rows: list[dict] = []
    eval_result = None
    for n in steps:
        step = by_number[n]
        t0 = time.perf_counter()
        _log(f"step {n}: {step.title} ({step.flags})")
        try:
            if step.dtype is None:
                row = run_hf_step(step, workloads, args, args.results_dir)
            else:
                row = run_server_step(step, workloads, single, args, args.results_dir)
        except Exception as e:  # noqa: BLE001 - a step that breaks is reported, and the ladder goes on
            _log(f"step {n} failed: {type(e).__name__}: {e}")
            row = _new_row(step)
            row["error"] = f"{type(e).__name__}: {e}"
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        if n == 3 and not args.skip_eval:
            eval_result = run_eval(args, args.results_dir)
            meta["eval"] = eval_result
    if pair is not None:
        try:
            meta["draft_step"] = run_draft_step(*pair, args.draft_output_len, args.results_dir)
        except Exception as e:  # noqa: BLE001 - reported in the table, like a failed step
            _log(f"step 5, draft model, failed: {type(e).__name__}: {e}")
            meta["draft_step"] = {"error": f"{type(e).__name__}: {e}"}
    compute_gates(rows, eval_result)
    meta["total_seconds"] = round(time.perf_counter() - t_start, 1)
    report = write_outputs(rows, meta, args.results_dir, args.result_json)
    print("\n" + report)
    print(f"results in {args.results_dir}/ (results.json, results.md, chart.png); "
          f"{meta['total_seconds'] / 60:.1f} min in all")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """``python -m tools.ladder``'s parser (``func``: ``main``)."""
    p = argparse.ArgumentParser(prog="python -m tools.ladder", description="the optimization ladder, step by step: "
                                "speed, memory and quality gates")
    add_args(p)
    p.set_defaults(func=main)
    return p


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=32, help="prompts per workload")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32, help="client concurrency of the server steps")
    p.add_argument("--steps", type=int, nargs="+", choices=[1, 2, 3, 4, 5], default=[1, 2, 3, 4, 5],
                   help="run these steps only (gates and speedups needing a missing step show n/a)")
    p.add_argument("--skip-hf", action="store_true", help="leave out step 1 (HF transformers)")
    p.add_argument("--skip-eval", action="store_true", help="leave out step 3's `pagedllm eval` gate")
    p.add_argument("--eval-args", default="", help="more `pagedllm eval` flags, e.g. '--eval-tokens 1024'")
    p.add_argument("--gate-prompts", type=int, default=8,
                   help="prompts per shared-prefix / code-rewrite set whose greedy outputs the gates compare")
    p.add_argument("--hf-subset-prompts", type=int, default=8,
                   help="step 1 runs the shared-prefix and code-rewrite sets on this many prompts (0: skip them)")
    p.add_argument("--single-stream-prompts", type=int, default=4,
                   help="code-rewrite prompts measured one at a time per server step (0: skip)")
    p.add_argument("--spec-config", type=json.loads, default=NGRAM_CONFIG,
                   help=f"step 5's --speculative-config (default {json.dumps(NGRAM_CONFIG)})")
    p.add_argument("--draft-pair", default=None, metavar="TARGET,DRAFT",
                   help="step 5 also measures draft-model speculation on this target/draft pair (same tokenizer); "
                        "default: the Qwen2.5-Coder 1.5B/0.5B pair when both were fetched with `pagedllm fetch`")
    p.add_argument("--no-draft", action="store_true", help="no draft-model table, even when the pair is fetched")
    p.add_argument("--draft-output-len", type=int, default=128, help="output tokens per draft-step request")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--results-dir", default="results/ladder")
    add_result_json_arg(p)


def _phase_main() -> int:
    """A step-1 phase in its own process: HF one at a time on a prompts file, keeping the token ids."""
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["hf-ids"], required=True)
    add_workload_args(p, num_prompts=None, output_len=None, prompts_file_required=True)
    a = p.parse_args()
    r = run_hf_one_at_a_time(load_prompts(a.prompts_file)[: a.num_prompts], a.output_len, "float32")
    r["peak_rss_bytes"] = _peak_rss()
    print(json.dumps(r))
    return 0
