"""A CPU hardware profile from ``pagedllm bench roofline --result-json`` output.

What the roofline JSON measures and what each becomes:
- ``bandwidth_gbs`` (a 512 MiB copy), ``peak_gflops_float32`` / ``peak_gflops_bfloat16`` (2048^3 matmuls): the
  profile's memory bandwidth and fp32 / bf16 peaks;
- ``runtime.weight_plan.timings_ms.layers.block`` (the engine's own decoder-layer linears through the qlinear
  block kernel at 1, 4, ..., 256 rows; else the ``block_kernel`` rows at batch 1 / 8 / 32): the integer GEMM
  path's peak (the fastest rate measured), its efficiency by row count (the points that are compute-bound), and
  the attainable bandwidth fraction (the one-row point, which streams the weights);
- ``layer_linears_ms`` (runs since 2026-12-06: the engine's decoder-layer linears as built, at 1-2048 rows, each
  row count on the path the engine runs there) takes the place of those kernel timings where present: the GEMM
  curve then reaches prefill-sized steps (bfloat16 tiles and stripes on AMX CPUs, not the integer kernel's rate);
- ``rows`` (engine decode steps at batch 1 / 8 / 32 / 64, context ~78 tokens, and ~334 in runs since 2026-12-06:
  each row's own ``prompt_len`` where the run had several): after subtracting the roofline terms the cost model predicts for those steps, a line
  ``fixed + per_row x batch`` fitted to the rest (least squares on relative errors) gives the per-step overhead and
  the per-row overhead. Steps at two contexts or more also fit attention's efficiency (a grid from 0.01 to 1, each
  with its own overheads, the smallest relative error kept); one context keeps the assumed 0.3.

A decode row is one token of one sequence, so decode steps cannot tell per-token costs (norms, rotary, KV writes:
paid by every prefill token too) from per-sequence costs (sampling, detokenization, scheduling: paid once per
request per step). ``token_share`` splits the fitted per-row overhead between the two; it is not identified by
the roofline data (see docs/simulate.md for how the predictions move with it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from pagedllm.sim.cost import CostModel, Deployment
from pagedllm.sim.hardware import GIB, HardwareProfile
from pagedllm.sim.model_profile import PRESETS, SCHEMES, ModelProfile, QuantScheme

# pagedllm/bench/roofline.py's engine_decode: prompts of `prompt_len` tokens (64 in files that predate the field),
# 24 timed steps after 2 warm-up steps: the mean context of a timed step is prompt_len + 2 + 24 / 2 tokens
ROOFLINE_DECODE_STEPS_OFFSET = 2 + 24 // 2
# the roofline run's KV cache dtype (runtime.kv_cache_dtype; float32 in files that predate the field)
ROOFLINE_KV_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}
CPU_KV_CACHE_BYTES = 1 * GIB  # the CPU engine's default --kv-cache-memory
DEFAULT_TOKEN_SHARE = 0.5


@dataclass(frozen=True)
class Calibration:
    profile: HardwareProfile
    model: ModelProfile
    scheme: QuantScheme
    fixed_overhead_s: float
    row_overhead_s: float
    token_share: float
    fit_rows: tuple[tuple[int, float, float], ...]  # (batch, measured s, predicted s with the fitted overheads)
    notes: tuple[str, ...] = field(default=())
    kv_dtype: str = "fp32"  # the KV cache of the measured engine (bf16 on the default CPU path since 2026-12-02)

    def deployment(self, kv_cache_bytes: int = CPU_KV_CACHE_BYTES) -> Deployment:
        """The measured engine's CPU setup: this model and format, tp=1, its KV dtype in a fixed pool."""
        return Deployment(self.profile, self.model, self.scheme, tp=1, kv_dtype=self.kv_dtype,
                          kv_cache_bytes=kv_cache_bytes)

    def describe(self) -> str:
        p = self.profile
        curve = ", ".join(f"{r}: {e:.2f}" for r, e in p.gemm_efficiency_curve)
        lines = [
            f"cpu-local calibrated from bench roofline ({p.description}):",
            f"  bandwidth {p.memory_bw / 1e9:.1f} GB/s x {p.bandwidth_efficiency:.2f} attainable (weights at one row); "
            f"fp32 {p.fp32_flops / 1e9:.0f}, bf16 {p.bf16_flops / 1e9:.0f} GFLOP/s; integer block kernel peak "
            f"{p.int8_flops / 1e9:.0f} GFLOP/s, efficiency by rows {{{curve}}}",
            f"  overheads: {self.fixed_overhead_s * 1e3:.2f} ms per step + {self.row_overhead_s * 1e3:.3f} ms per "
            f"decode row (token share {self.token_share:g}: {p.token_overhead_s * 1e3:.3f} ms per token, "
            f"{p.seq_overhead_s * 1e3:.3f} ms per sequence)",
            "  decode steps (batch: measured / fitted ms): " + ", ".join(
                f"{b}: {m * 1e3:.1f} / {q * 1e3:.1f}" for b, m, q in self.fit_rows),
        ]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _least_squares(xs: list[float], ys: list[float], ws: list[float]) -> tuple[float, float]:
    """Weighted least-squares line: (intercept, slope); one point: all intercept."""
    if len(xs) == 1:
        return ys[0], 0.0
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def _gemm_points(d: dict, model: ModelProfile) -> tuple[dict[int, float], str]:
    """Seconds of one forward's decoder-layer linears at each measured row count."""
    if d.get("layer_linears_ms"):  # the engine's own linears, each row count on the path it runs there
        return {int(k): v / 1e3 for k, v in d["layer_linears_ms"].items()}, "the engine's layer linears"
    plan = (d.get("runtime") or {}).get("weight_plan") or {}
    layers = ((plan.get("timings_ms") or {}).get("layers") or {}).get("block")
    if layers:
        return {int(k): v / 1e3 for k, v in layers.items()}, "runtime.weight_plan layer timings"
    rows = d.get("block_kernel") or []
    if rows:
        per_batch: dict[int, float] = {}
        for r in rows:  # per shape and batch: us for one matrix, `count` of them per forward
            per_batch[r["batch"]] = per_batch.get(r["batch"], 0.0) + r["us"] * 1e-6 * r["count"]
        # the block-kernel rows include the LM head (count 1): scale to the layers' share of MACs
        macs_layers = model.active_linear_params
        macs_all = macs_layers + model.embedding_params
        return {b: t * macs_layers / macs_all for b, t in per_batch.items()}, "block_kernel rows"
    return {}, ""


def cpu_profile_from_roofline(d: dict, model: ModelProfile | None = None, scheme: QuantScheme | None = None,
                              token_share: float = DEFAULT_TOKEN_SHARE, memory_bytes: int = 16 * GIB,
                              price_per_hour: float = 0.10, attention_efficiency: float = 0.3) -> Calibration:
    """Fit the ``cpu-local`` profile to a roofline result (``model`` / ``scheme``: what roofline ran, by default
    the embedded SmolLM2-135M Q4_1 file). ``attention_efficiency``: the assumption where the decode steps came at
    one context; with several it is fitted, this value breaking ties (efficiencies at which attention is bound by
    bandwidth predict the same steps)."""
    if not 0 <= token_share <= 1:
        raise ValueError(f"token_share must be in [0, 1], got {token_share}")
    for k in ("bandwidth_gbs", "peak_gflops_float32", "peak_gflops_bfloat16"):
        if k not in d:
            raise ValueError(f"not a `pagedllm bench roofline --result-json` file: no {k!r}")
    model = model or PRESETS["smollm2-135m"]
    scheme = scheme or model.gguf_scheme or SCHEMES["q4_1"]
    notes = []
    bw = d["bandwidth_gbs"] * 1e9
    fp32, bf16 = d["peak_gflops_float32"] * 1e9, d["peak_gflops_bfloat16"] * 1e9
    points, src = _gemm_points(d, model)
    macs_row = model.active_linear_params
    if points:
        rates = {m: 2 * m * macs_row / t for m, t in points.items()}
        peak = max(rates.values())
        one = min(points)
        layer_bytes = sum(scheme.linear.matrix_bytes(g.in_features, g.out_features) * g.layers * g.touched(one)
                          for g in model.linear_groups())
        bw_eff = min(1.0, layer_bytes / points[one] / bw)
        curve = tuple((m, rates[m] / peak) for m in sorted(points) if m > one)  # the one-row point is bandwidth-bound
        notes.append(f"GEMM points from {src}")
    else:
        peak, bw_eff, curve = bf16, 0.6, ()
        notes.append("no integer-kernel timings in the file: the bf16 peak at 0.65 stands in for the GEMM path")
    kv = ROOFLINE_KV_DTYPES.get((d.get("runtime") or {}).get("kv_cache_dtype"), "fp32")
    cpu = d.get("cpu") or {}
    desc = f"{cpu.get('model', 'CPU')} ({', '.join(cpu.get('flags', []))}), {d.get('threads', '?')} threads"
    base = HardwareProfile(
        name="cpu-local", description=desc, fp32_flops=fp32, bf16_flops=bf16, fp8_flops=0.0, int8_flops=peak,
        memory_bw=bw, memory_bytes=memory_bytes, interconnect_bw=10e9, interconnect_latency_s=20e-6,
        compute_efficiency=curve[-1][1] if curve else 0.65, bandwidth_efficiency=bw_eff,
        attention_efficiency=attention_efficiency, gemm_efficiency_curve=curve, step_overhead_s=0.0,
        seq_overhead_s=0.0, token_overhead_s=0.0, activation_bytes=4, attention_dtype="fp32", default_kv_dtype=kv,
        activation_reserve_bytes=0, price_per_hour=price_per_hour, calibrated=True, source="bench roofline",
    )
    # (batch, context of a timed step, seconds): a row's own prompt length where the run had several
    rows = sorted((r["batch"], r.get("prompt_len", d.get("prompt_len", 64)) + ROOFLINE_DECODE_STEPS_OFFSET,
                   r["step_ms"] / 1e3) for r in d.get("rows", []))
    # steps at two contexts or more: attention's efficiency is fitted over a grid, not assumed
    contexts = sorted({c for _, c, _ in rows})
    effs = ATTENTION_EFFICIENCY_GRID if len(contexts) > 1 else (attention_efficiency,)
    fits = [_fit_overheads(base.with_overrides(attention_efficiency=e), model, scheme, kv, rows) for e in effs]
    best = min(f[0] for f in fits)
    # efficiencies where attention is bound by bandwidth fit alike: of those, the one nearest the assumption
    fitted = min((f for f in fits if f[0] <= best * (1 + 1e-6) + 1e-12),
                 key=lambda f: abs(math.log(f[1].attention_efficiency / attention_efficiency)))
    if len(contexts) > 1:
        notes.append(f"attention efficiency {fitted[1].attention_efficiency:.3g}, fitted from decode steps at "
                     f"contexts of {', '.join(map(str, contexts))} tokens")
    _, base, fixed, per_row, fit = fitted
    if not rows:
        notes.append("no engine decode rows in the file: overheads default to 3 ms per step")
    profile = base.with_overrides(step_overhead_s=fixed, seq_overhead_s=per_row * (1 - token_share),
                                  token_overhead_s=per_row * token_share)
    return Calibration(profile, model, scheme, fixed, per_row, token_share, fit, tuple(notes), kv)


# attention efficiencies tried where the decode steps came at several contexts: 0.01 to 1, log-spaced
ATTENTION_EFFICIENCY_GRID = tuple(10 ** (-2 + 2 * i / 40) for i in range(41))


def _fit_overheads(base: HardwareProfile, model: ModelProfile, scheme: QuantScheme, kv: str, rows: list):
    """The per-step and per-row overheads that, added to ``base``'s roofline terms, fit the decode steps ``rows``
    ((batch, context, seconds)) best in relative terms (step times span 10x from batch 1 to 32) -> (sum of squared
    relative errors, base, fixed, per row, ((batch, measured, fitted) per row))."""
    dep = Deployment(base, model, scheme, kv_dtype=kv, kv_cache_bytes=CPU_KV_CACHE_BYTES)
    bare = CostModel(dep, include_overheads=False)
    predicted = [bare.decode_step(b, c - 1).time_s for b, c, _ in rows]
    if rows:
        fixed, per_row = _least_squares([b for b, _, _ in rows], [t - p for (_, _, t), p in zip(rows, predicted)],
                                        [1 / t**2 for _, _, t in rows])
        if per_row < 0:
            fixed, per_row = sum(t - p for (_, _, t), p in zip(rows, predicted)) / len(rows), 0.0
        fixed = max(fixed, 0.0)
    else:
        fixed, per_row = 0.003, 0.0
    fit = tuple((b, t, p + fixed + per_row * b) for (b, _, t), p in zip(rows, predicted))
    return sum((f / t - 1) ** 2 for _, t, f in fit), base, fixed, per_row, fit


def load_roofline(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
