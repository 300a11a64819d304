"""The optimization ladder, simulated: each row adds one step to the one before, on the same trace.

1. naive static batching with a max-length KV reservation per slot, bf16, the given tensor-parallel size;
2. paged KV cache + continuous batching (the real scheduler), bf16, same devices;
3. + AWQ 4-bit weights, on one device when it fits (a max-length request's KV next to the weights), else the
   same devices;
4. + prefix caching: the trace's shared prefix (a system prompt) is found in the real prefix cache;
5. + speculative decoding: k drafts per step, each accepted with probability alpha (through the scheduler's
   lookahead slots and rejection roll-back).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedllm.sim.cost import Deployment
from pagedllm.sim.hardware import HardwareProfile
from pagedllm.sim.metrics import Summary
from pagedllm.sim.model_profile import SCHEMES, ModelProfile, QuantScheme
from pagedllm.sim.naive import simulate_static
from pagedllm.sim.simulator import EngineSettings, SpecDecoding, simulate
from pagedllm.sim.trace import Workload


@dataclass(frozen=True)
class LadderRow:
    step: int
    label: str
    summary: Summary | None  # None: the step cannot run (does not fit)
    note: str = ""


@dataclass(frozen=True)
class LadderConfig:
    hardware: HardwareProfile
    model: ModelProfile
    tp: int
    workload: Workload  # should carry a shared prefix for step 4 to matter
    settings: EngineSettings = EngineSettings()
    base_scheme: QuantScheme = SCHEMES["bf16"]
    quant_scheme: QuantScheme = SCHEMES["awq"]
    spec: SpecDecoding = SpecDecoding(4, 0.7)
    kv_dtype: str = ""
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int | None = None
    seed: int = 0


def run_ladder(cfg: LadderConfig) -> list[LadderRow]:
    def dep(scheme: QuantScheme, tp: int) -> Deployment:
        return Deployment(cfg.hardware, cfg.model, scheme, tp, cfg.kv_dtype, cfg.gpu_memory_utilization,
                          cfg.kv_cache_bytes)

    max_len = cfg.settings.max_model_len or cfg.model.max_position
    base = replace(cfg.settings, enable_prefix_caching=False, spec=None)
    rows: list[LadderRow] = []

    def attempt(step: int, label: str, fn, note: str = "") -> None:
        try:
            s = fn()
        except (ValueError, RuntimeError) as e:
            rows.append(LadderRow(step, label, None, f"does not run: {e}"))
            return
        extra = [note] if note else []
        if s.notes:
            extra.append(s.notes)
        if s.preemptions:
            extra.append(f"{s.preemptions} preemptions")
        if s.prefix_hit_rate:
            extra.append(f"prefix hits {100 * s.prefix_hit_rate:.0f}% of prompt tokens")
        if s.spec_mean_accepted is not None:
            extra.append(f"{s.spec_mean_accepted:.2f} drafts accepted per verify")
        rows.append(LadderRow(step, label, s, "; ".join(extra)))

    d1 = dep(cfg.base_scheme, cfg.tp)
    attempt(1, f"naive static batching, {cfg.base_scheme.name}, tp={cfg.tp}",
            lambda: simulate_static(d1, cfg.workload, max_len, cfg.settings.max_num_seqs, cfg.seed).summary)
    attempt(2, f"paged KV + continuous batching, {cfg.base_scheme.name}, tp={cfg.tp}",
            lambda: simulate(d1, cfg.workload, base, cfg.seed).summary)
    q_tp, q_note = cfg.tp, ""
    if cfg.tp > 1:
        one = dep(cfg.quant_scheme, 1)
        if one.memory_plan(cfg.settings.block_size).sequences_that_fit(max_len) >= 1:
            q_tp = 1
        else:
            q_note = f"does not fit on one {cfg.hardware.name} with a {max_len}-token KV: kept tp={cfg.tp}"
    dq = dep(cfg.quant_scheme, q_tp)
    attempt(3, f"+ {cfg.quant_scheme.name} weights, tp={q_tp}",
            lambda: simulate(dq, cfg.workload, base, cfg.seed).summary, q_note)
    cached = replace(base, enable_prefix_caching=True)
    attempt(4, "+ prefix caching", lambda: simulate(dq, cfg.workload, cached, cfg.seed).summary)
    sp = cfg.spec
    attempt(5, f"+ speculative decoding (k={sp.num_speculative_tokens}, alpha={sp.acceptance_rate:g})",
            lambda: simulate(dq, cfg.workload, replace(cached, spec=sp), cfg.seed).summary,
            f"expected {sp.expected_tokens_per_step:.2f} tokens per verify step")
    return rows


def _fmt_s(x: float) -> str:
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def ladder_markdown(rows: list[LadderRow]) -> str:
    base = rows[0].summary if rows and rows[0].summary else None
    cols = ["step", "system", "devices", "output tok/s", "tok/s per device", "per-stream tok/s", "mean latency (s)",
            "p99 latency (s)", "mean TTFT (s)", "memory: weights + KV (GiB)", "speedup vs 1", "$/M output tok", "notes"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        s = r.summary
        if s is None:
            out.append(f"| {r.step} | {r.label} | " + "— | " * (len(cols) - 3) + f"{r.note} |")
            continue
        speed = f"{s.output_tok_s / base.output_tok_s:.1f}x" if base else "—"
        mem = " + ".join(f"{b / 2**30:.0f}" if b >= 10 * 2**30 else f"{b / 2**30:.2g}"
                         for b in (s.weights_bytes, s.kv_pool_bytes))
        out.append(
            f"| {r.step} | {r.label} | {s.num_devices} | {s.output_tok_s:.0f} | {s.output_tok_s / s.num_devices:.0f} "
            f"| {s.stream_tok_s:.1f} | {_fmt_s(s.mean_latency_s)} | {_fmt_s(s.p99_latency_s)} "
            f"| {_fmt_s(s.mean_ttft_s)} "
            f"| {mem} | {speed} | {s.cost_per_m_tokens:.2f} | {r.note} |")
    return "\n".join(out)


QUOTED_70B_A100X2 = (
    "Commonly quoted for Llama-3-70B on 2 x A100-80GB: below 20 tok/s for a naive deployment, 60-80 tok/s after a "
    "paged KV cache and continuous batching, up to 5-10x in total with quantization, prefix caching and "
    "speculation. Those figures are usually single-stream or small-batch numbers (one request's decode speed, or "
    "throughput at a handful of concurrent users); compare them with the per-stream column at low concurrency, "
    "not with the aggregate output tok/s of a loaded server above."
)


def write_ladder_chart(rows: list[LadderRow], title: str, path: str) -> None:
    """A PNG: output tok/s and mean TTFT per ladder step (matplotlib, imported here: it is optional here and
    imports no torch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.summary is not None]
    labels = [f"{r.step}. {r.label}" for r in done]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.6 * len(done) + 2), sharey=True)
    a.barh(labels, [r.summary.output_tok_s for r in done], color="tab:blue")
    a.set_xlabel("output tok/s (predicted)")
    b.barh(labels, [r.summary.mean_ttft_s for r in done], color="tab:orange")
    b.set_xlabel("mean TTFT, s (predicted)")
    a.invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
