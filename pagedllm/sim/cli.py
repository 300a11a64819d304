"""`pagedllm simulate`: a deployment's throughput, latency, memory and cost, predicted with the real scheduler.

Examples:
    pagedllm simulate --model llama-3-70b --gpu a100-80gb --tp 2 --ladder
    pagedllm simulate --model qwen2.5-7b --gpu l40s --quantization fp8 --rate 4 --num-requests 500
    pagedllm simulate --model llama-3-70b --kv-calc
    pagedllm simulate --calibrate tests/data/roofline_epyc.json --validate tests/data/serve_w1_epyc.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from pagedllm.routing import POLICIES
from pagedllm.sim.calibrate import CPU_KV_CACHE_BYTES, DEFAULT_TOKEN_SHARE, cpu_profile_from_roofline, load_roofline
from pagedllm.sim.cost import Deployment
from pagedllm.sim.hardware import GPU_PROFILES, get_gpu_profile
from pagedllm.sim.kvcalc import KV_DTYPE_BYTES, kv_report
from pagedllm.sim.ladder import QUOTED_70B_A100X2, LadderConfig, ladder_markdown, run_ladder, write_ladder_chart
from pagedllm.sim.model_profile import PRESETS, SCHEMES, get_scheme, human_bytes, human_count, load_model_profile
from pagedllm.sim.naive import simulate_static
from pagedllm.sim.simulator import EngineSettings, SpecDecoding, simulate
from pagedllm.sim.trace import W1_OUTPUT_LEN, LengthDist, Workload, load_trace, synthetic, w1, with_shared_prefix
from pagedllm.sim.validate import DEFAULT_CLIENT_JITTER_S, load_measured, validate, validation_markdown

LADDER_SHARED_PREFIX = 400

OUTPUT = "128-256"  # --output-len of the synthetic workloads


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deployment")
    g.add_argument("--model", default=None,
                   help=f"preset ({', '.join(PRESETS)}), a .gguf file or a config.json / HF directory "
                        "(default: llama-3-70b; smollm2-135m with --calibrate)")
    g.add_argument("--gpu", default=None, help=f"{', '.join(GPU_PROFILES)}, or cpu-local (needs --calibrate)")
    g.add_argument("--calibrate", metavar="ROOFLINE_JSON", default=None,
                   help="build the cpu-local profile from `pagedllm bench roofline --result-json` output")
    g.add_argument("--token-share", type=float, default=DEFAULT_TOKEN_SHARE,
                   help="cpu-local: share of the fitted per-decode-row overhead charged per token (rest per sequence)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--quantization", default=None,
                   help=f"weights: {', '.join(SCHEMES)}, or gguf (the file's formats); default bf16 (gguf / q4_1 on "
                        "cpu-local)")
    g.add_argument("--kv-dtype", default=None, choices=sorted(KV_DTYPE_BYTES), help="default: bf16 (fp32 on cpu-local)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="fixed KV pool per device in bytes "
                   "(default: memory left after weights; 1 GiB on cpu-local, the CPU engine's default)")
    g.add_argument("--price-per-gpu-hour", type=float, default=None, help="$ per device-hour (default: the profile's)")
    g.add_argument("--compute-efficiency", type=float, default=None, help="attainable fraction of peak FLOP/s")
    g.add_argument("--bandwidth-efficiency", type=float, default=None, help="attainable fraction of memory bandwidth")
    g.add_argument("--step-overhead-ms", type=float, default=None, help="fixed time per engine step")

    e = p.add_argument_group("engine (same flags as pagedllm serve)")
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--spec-tokens", type=int, default=0, help="speculative decoding: drafts per step (0: off)")
    e.add_argument("--spec-acceptance", type=float, default=0.7, help="per-token draft acceptance probability")
    e.add_argument("--spec-draft-model", default=None, help="price a draft model (preset / path); default: free "
                   "n-gram drafts")
    e.add_argument("--spec-disable-by-batch-size", type=int, default=None)

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=["synthetic", "w1"], default="synthetic",
                   help="w1: the 32 shipped prompts of bench compare, 128 output tokens")
    w.add_argument("--trace", default=None, help="a recorded trace JSON (or a bench serve result file)")
    w.add_argument("--num-requests", type=int, default=256)
    w.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (default: all at t=0)")
    w.add_argument("--concurrency", type=int, default=None, help="closed loop: this many clients (bench serve's "
                   "--max-concurrency)")
    w.add_argument("--prompt-len", default="100-300", help="N or LOW-HIGH (uniform), before the shared prefix")
    w.add_argument("--output-len", default=None, help="N or LOW-HIGH (uniform; default 128-256; --workload w1: N, "
                   "default its 128)")
    w.add_argument("--shared-prefix-len", type=int, default=None,
                   help=f"tokens of a system prompt shared by every request (default 0; {LADDER_SHARED_PREFIX} with "
                        "--ladder)")
    w.add_argument("--num-prefixes", type=int, default=1,
                   help="--shared-prefix-len: this many different shared prefixes, one drawn at random per request")
    w.add_argument("--client-jitter-ms", type=float, default=DEFAULT_CLIENT_JITTER_S * 1e3,
                   help="closed loop: a client's turnaround before its next request, uniform in [0, this]")
    w.add_argument("--seed", type=int, default=0)

    r = p.add_argument_group("replicas")
    r.add_argument("--replicas", type=int, default=1,
                   help="engines behind a router (serve --data-parallel-size, or servers behind vllm-router), each "
                        "one deployment as above with its own KV cache")
    r.add_argument("--routing", choices=POLICIES, default="cache_aware", help="how the router picks a replica")
    r.add_argument("--lend-calibrate", metavar="ROOFLINE_JSON", default=None,
                   help="with --replicas and --calibrate (one replica's share of the cores): the roofline of the "
                        "whole machine; a step that starts while the other replicas are idle is priced on it, as "
                        "`serve --data-parallel-size` replicas lend idle cores (default: each on its own share)")
    r.add_argument("--plan-rate", type=float, nargs="+", default=None, metavar="REQ_PER_S",
                   help="size a deployment: the fewest replicas that serve this many requests/s (Poisson, the "
                        "workload flags' lengths) within --slo-p99-ttft-s; one replica is simulated at its share "
                        "of the rate")
    r.add_argument("--slo-p99-ttft-s", type=float, default=2.0, help="--plan-rate: the p99 TTFT to meet")

    m = p.add_argument_group("modes")
    m.add_argument("--ladder", action="store_true", help="the optimization ladder as a markdown table")
    m.add_argument("--static-batching", action="store_true", help="simulate naive static batching instead")
    m.add_argument("--kv-calc", action="store_true", help="KV cache size with and without GQA, then exit")
    m.add_argument("--kv-batch", type=int, default=1, help="--kv-calc: sequences")
    m.add_argument("--validate", metavar="MEASURED_JSON", default=None,
                   help="compare the calibrated cpu-local profile with measured bench serve runs (needs --calibrate)")
    m.add_argument("--result-json", default=None)
    m.add_argument("--chart", default=None, help="with --ladder: write a PNG chart of the ladder here")


def _hardware(args):
    if args.calibrate:
        cal = cpu_profile_from_roofline(load_roofline(args.calibrate), token_share=args.token_share)
        if args.gpu not in (None, "cpu-local"):
            raise ValueError("--calibrate builds the cpu-local profile: leave out --gpu or give --gpu cpu-local")
        hw = cal.profile
    else:
        if args.gpu == "cpu-local":
            raise ValueError("--gpu cpu-local needs --calibrate ROOFLINE_JSON (pagedllm bench roofline --result-json)")
        cal, hw = None, get_gpu_profile(args.gpu or "a100-80gb")
    return cal, _overridden(hw, args)


def _overridden(hw, args):
    """``hw`` with the hardware flags the user gave."""
    return hw.with_overrides(price_per_hour=args.price_per_gpu_hour, compute_efficiency=args.compute_efficiency,
                             bandwidth_efficiency=args.bandwidth_efficiency,
                             step_overhead_s=None if args.step_overhead_ms is None else args.step_overhead_ms / 1e3)


def _workload(args, shared_default: int) -> Workload:
    jitter = args.client_jitter_ms / 1e3
    shared = shared_default if args.shared_prefix_len is None else args.shared_prefix_len
    if args.trace:
        w = load_trace(args.trace, args.concurrency)
    elif args.workload == "w1":
        w = w1(args.concurrency or 32, output_len=int(args.output_len) if args.output_len else W1_OUTPUT_LEN)
    else:
        w = synthetic(args.num_requests, LengthDist.parse(args.prompt_len),
                      LengthDist.parse(args.output_len or OUTPUT),
                      args.rate, args.concurrency, shared, args.seed, args.num_prefixes)
        return replace(w, client_jitter_s=jitter)
    return replace(with_shared_prefix(w, shared), client_jitter_s=jitter)


def _settings(args) -> EngineSettings:
    """The engine flags; speculative decoding without its draft model's deployment (main() adds it)."""
    spec = None
    if args.spec_tokens:
        spec = SpecDecoding(args.spec_tokens, args.spec_acceptance, None, args.spec_disable_by_batch_size)
    return EngineSettings(args.max_num_seqs, args.max_num_batched_tokens, args.block_size, args.enable_prefix_caching,
                          args.enable_chunked_prefill, args.max_model_len, spec=spec)


def _describe_deployment(dep: Deployment, settings: EngineSettings) -> str:
    plan = dep.memory_plan(settings.block_size, settings.max_num_seqs, settings.enable_prefix_caching)
    hw = dep.hardware
    cal = "calibrated (bench roofline)" if hw.calibrated else "uncalibrated datasheet profile"
    out = (f"{dep.model.name} ({human_count(dep.model.num_params)} params), {dep.scheme.name} weights "
           f"{human_bytes(dep.weight_bytes)}, KV {dep.kv_dtype} {human_bytes(dep.kv_bytes_per_token_device * dep.tp)}"
           f"/token on {dep.tp} x {hw.name} [{cal}]: KV pool {human_bytes(plan.kv_pool_per_device)} per device = "
           f"{plan.kv_tokens:,} tokens")
    if plan.state_slots:
        out += (f"; recurrent states ({len(dep.model.state_layers())} layers) "
                f"{human_bytes(plan.state_bytes_per_slot)}/sequence x {plan.state_slots} slots = "
                f"{human_bytes(plan.state_bytes_per_device)}"
                + (f" ({plan.state_live_slots} for running sequences, the rest for prefix snapshots)"
                   if plan.state_live_slots < plan.state_slots else ""))
    return out


def _summary_table(s) -> str:
    rows = [("output tok/s", f"{s.output_tok_s:.1f}"), ("per-stream tok/s (1 / mean TPOT)", f"{s.stream_tok_s:.1f}"),
            ("mean / p99 TTFT (s)", f"{s.mean_ttft_s:.3f} / {s.p99_ttft_s:.3f}"),
            ("mean / p99 TPOT (ms)", f"{s.mean_tpot_s * 1e3:.1f} / {s.p99_tpot_s * 1e3:.1f}"),
            ("mean / p99 latency (s)", f"{s.mean_latency_s:.2f} / {s.p99_latency_s:.2f}"),
            ("duration (s)", f"{s.duration_s:.2f}"), ("steps", f"{s.num_steps}"),
            ("KV usage max / mean", f"{100 * s.kv_usage_max:.1f}% / {100 * s.kv_usage_mean:.1f}%"),
            ("preemptions", f"{s.preemptions}"), ("prefix cache hit rate", f"{100 * s.prefix_hit_rate:.1f}%"),
            ("memory: weights + KV pool", f"{human_bytes(s.weights_bytes)} + {human_bytes(s.kv_pool_bytes)}"
                                          + (f" + {human_bytes(s.state_pool_bytes)} of recurrent states"
                                             if s.state_pool_bytes else "")),
            ("$ per million output tokens", f"{s.cost_per_m_tokens:.3f} at ${s.price_per_device_hour:.2f}/device-hour "
                                            f"x {s.num_devices}")]
    if s.spec_mean_accepted is not None:
        rows.append(("drafts accepted per verify step", f"{s.spec_mean_accepted:.2f}"))
    return "\n".join(["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def main(args: argparse.Namespace) -> int:
    cal, hw = _hardware(args)
    model = load_model_profile(args.model) if args.model else (cal.model if cal else PRESETS["llama-3-70b"])
    if args.quantization:
        scheme = get_scheme(args.quantization, model)
    elif cal is not None:
        scheme = model.gguf_scheme or cal.scheme
    else:
        scheme = SCHEMES["bf16"]
    kv_cache = args.kv_cache_memory
    if kv_cache is None and cal is not None:
        kv_cache = CPU_KV_CACHE_BYTES  # the CPU engine's default --kv-cache-memory
    result: dict = {"model": model.name, "hardware": hw.name, "tp": args.tp, "quantization": scheme.name}
    if args.kv_calc:
        _kv_calc(args, model, result)
    elif args.validate:
        if cal is None:
            raise ValueError("--validate needs --calibrate ROOFLINE_JSON")
        _validate(args, cal, result)
    else:
        settings = _settings(args)
        if args.spec_draft_model and not args.spec_tokens:
            raise ValueError("--spec-draft-model needs --spec-tokens K")
        if args.spec_tokens and args.spec_draft_model:
            draft = Deployment(hw, load_model_profile(args.spec_draft_model), scheme, args.tp, args.kv_dtype or "",
                               args.gpu_memory_utilization, kv_cache)
            settings = replace(settings, spec=replace(settings.spec, draft=draft))
        if args.ladder:
            _ladder(args, cal, hw, model, scheme, kv_cache, settings, result)
        elif args.plan_rate:
            dep = Deployment(hw, model, scheme, args.tp, args.kv_dtype or "", args.gpu_memory_utilization, kv_cache)
            _plan(args, dep, settings, result)
        else:
            dep = Deployment(hw, model, scheme, args.tp, args.kv_dtype or "", args.gpu_memory_utilization, kv_cache)
            _one(args, dep, settings, result)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _kv_calc(args, model, result: dict) -> None:
    rep = kv_report(model, args.kv_dtype or "bf16", args.max_model_len or model.max_position, args.kv_batch)
    print(rep.markdown())
    result["kv_calc"] = {"per_token": rep.per_token, "naive_per_token": rep.naive_per_token, "seq_len": rep.seq_len,
                         "batch": rep.batch, "overstatement": rep.overstatement}


def _validate(args, cal, result: dict) -> None:
    print(cal.describe())
    rows = validate(cal, load_measured(args.validate), args.client_jitter_ms / 1e3, args.seed)
    print()
    print(validation_markdown(rows))
    worst = max(abs(r.error) for r in rows if r.metric in ("output tok/s", "mean TTFT (s)"))
    print(f"\nlargest error on throughput and mean TTFT: {100 * worst:.1f}%")
    result["validation"] = [{"concurrency": r.concurrency, "metric": r.metric, "predicted": r.predicted,
                             "measured": r.measured, "error": r.error} for r in rows]


def _ladder(args, cal, hw, model, scheme, kv_cache, settings: EngineSettings, result: dict) -> None:
    wl = _workload(args, LADDER_SHARED_PREFIX)
    if args.concurrency is None and args.rate is None and not args.trace:
        wl = replace(wl, concurrency=64)
    spec = settings.spec or SpecDecoding(4, args.spec_acceptance)
    quant = (model.gguf_scheme or SCHEMES["q4_1"]) if cal is not None else SCHEMES["awq"]
    cfg = LadderConfig(hw, model, args.tp, wl, replace(settings, spec=None),
                       base_scheme=SCHEMES["bf16"] if args.quantization is None else scheme,
                       quant_scheme=quant, spec=spec, kv_dtype=args.kv_dtype or "",
                       gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_bytes=kv_cache, seed=args.seed)
    print(wl.describe())
    print(f"hardware: {hw.description} ({'calibrated' if hw.calibrated else 'uncalibrated datasheet figures'})\n")
    rows = run_ladder(cfg)
    print(ladder_markdown(rows))
    if model.name == "llama-3-70b" and hw.name == "a100-80gb" and args.tp == 2:
        print(f"\n{QUOTED_70B_A100X2}")
    if args.chart:
        write_ladder_chart(rows, f"{model.name} on {args.tp} x {hw.name}\n{wl.describe()}", args.chart)
        print(f"chart: {args.chart}")
    result["workload"] = wl.describe()
    result["ladder"] = [{"step": r.step, "label": r.label, "note": r.note,
                         "summary": r.summary.to_dict() if r.summary else None} for r in rows]


def plan_replicas(dep: Deployment, settings: EngineSettings, rate: float, slo_p99_ttft_s: float, args,
                  max_replicas: int = 100_000):
    """The fewest replicas of ``dep`` that keep the p99 TTFT within the SLO at ``rate`` requests/s, each replica
    simulated alone at rate / replicas (a router that spreads Poisson arrivals evenly); with the summary of that
    replica. None when even ``max_replicas`` do not."""
    def one(n: int):
        wl = synthetic(args.num_requests, LengthDist.parse(args.prompt_len),
                       LengthDist.parse(args.output_len or OUTPUT),
                       rate / n, None, args.shared_prefix_len or 0, args.seed, args.num_prefixes)
        s = simulate(dep, wl, settings, args.seed).summary
        return s if s.p99_ttft_s <= slo_p99_ttft_s else None

    hi = 1
    while one(hi) is None:  # doubling, then bisection on the first count that meets the SLO
        if hi >= max_replicas:
            return None
        hi *= 2
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if one(mid) is not None else (mid, hi)
    return hi, one(hi)


def _plan(args, dep: Deployment, settings: EngineSettings, result: dict) -> None:
    threads = None
    if args.calibrate:
        with open(args.calibrate) as f:
            threads = json.load(f).get("threads")
    print(_describe_deployment(dep, settings))
    plan = dep.memory_plan(settings.block_size, settings.max_num_seqs, settings.enable_prefix_caching)
    mem = dep.weight_bytes + (plan.kv_pool_per_device + plan.state_bytes_per_device) * dep.num_devices
    print(f"workload per replica: Poisson arrivals, prompts {args.prompt_len} tokens"
          + (f" + a {args.shared_prefix_len}-token shared prefix" if args.shared_prefix_len else "")
          + f", outputs {args.output_len or OUTPUT}; SLO p99 TTFT <= {args.slo_p99_ttft_s:g} s\n")
    unit = "cores" if threads else "devices"
    rows = ["| requests/s | replicas | " + unit + " | memory (weights + KV) | p99 / mean TTFT (s) | output tok/s per "
            "replica |", "|---|---|---|---|---|---|"]
    result["plan"] = []
    for rate in args.plan_rate:
        found = plan_replicas(dep, settings, rate, args.slo_p99_ttft_s, args)
        if found is None:
            rows.append(f"| {rate:g} | no count meets the SLO | | | | |")
            continue
        n, s = found
        units = n * dep.num_devices * (threads or 1)
        rows.append(f"| {rate:g} | {n} | {units} | {human_bytes(n * mem)} | {s.p99_ttft_s:.2f} / {s.mean_ttft_s:.2f} "
                    f"| {s.output_tok_s:.0f} |")
        result["plan"].append({"rate": rate, "replicas": n, unit: units, "memory_bytes": n * mem,
                               "p99_ttft_s": s.p99_ttft_s, "mean_ttft_s": s.mean_ttft_s,
                               "output_tok_s_per_replica": s.output_tok_s})
    print("\n".join(rows))


def _one(args, dep: Deployment, settings: EngineSettings, result: dict) -> None:
    wl = _workload(args, 0)
    print(_describe_deployment(dep, settings))
    if args.replicas > 1:
        print(f"{args.replicas} replicas of it behind a router ({args.routing}), each with its own KV cache")
    print(wl.describe() + "\n")
    if args.static_batching:
        res = simulate_static(dep, wl, settings.max_model_len, settings.max_num_seqs, args.seed)
    else:
        lend = None
        if args.lend_calibrate:
            if not args.calibrate or args.replicas < 2:
                raise ValueError("--lend-calibrate needs --calibrate (a replica's share) and --replicas N > 1")
            whole = cpu_profile_from_roofline(load_roofline(args.lend_calibrate), token_share=args.token_share)
            lend = replace(dep, hardware=_overridden(whole.profile, args))
            print(f"idle replicas lend their cores: a step alone runs on {whole.profile.description}")
        res = simulate(dep, wl, settings, args.seed, replicas=args.replicas, routing=args.routing, lend=lend)
    print(_summary_table(res.summary))
    result["workload"] = wl.describe()
    result.update(res.to_dict())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedllm simulate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    return p


def run(argv: list[str] | None = None) -> int:
    """Entry point without the rest of the command line (which imports the engine and torch)."""
    args = build_parser().parse_args(argv)
    try:
        return main(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run())
