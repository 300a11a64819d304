"""Validation: the CPU profile calibrated from ``bench roofline`` against measured ``bench serve`` runs.

The measured file (``tests/data/serve_w1_epyc.json``) holds the engine settings, the workload (per-request
prompt token counts, output length) and, per concurrency, the measured output tok/s and mean TTFT. Each
concurrency is simulated as a closed loop of that many clients with the calibrated profile; nothing in the
measured file feeds the calibration.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagedllm.sim.calibrate import Calibration
from pagedllm.sim.simulator import EngineSettings, simulate
from pagedllm.sim.trace import closed_loop

# a closed-loop client's turnaround: requests that finish in the same step reach the server spread over a few
# milliseconds, and an idle engine starts a step with the first one (any value from 0.5 to 5 ms gives the same
# predictions to 1%; 0 synchronizes the clients exactly, which a real client never does)
DEFAULT_CLIENT_JITTER_S = 0.002


@dataclass(frozen=True)
class ValidationRow:
    concurrency: int
    metric: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        """Relative error of the prediction."""
        return self.predicted / self.measured - 1


def load_measured(path: str) -> dict:
    with open(path) as f:
        d = json.load(f)
    for k in ("engine", "workload", "measured"):
        if k not in d:
            raise ValueError(f"{path}: not a measured-runs file (no {k!r})")
    return d


def validate(cal: Calibration, measured: dict, client_jitter_s: float = DEFAULT_CLIENT_JITTER_S,
             seed: int = 0) -> list[ValidationRow]:
    e = measured["engine"]
    settings = EngineSettings(max_num_seqs=e["max_num_seqs"], max_num_batched_tokens=e["max_num_batched_tokens"],
                              block_size=e["block_size"], enable_prefix_caching=e["enable_prefix_caching"],
                              enable_chunked_prefill=e.get("enable_chunked_prefill", True))
    dep = cal.deployment(kv_cache_bytes=e["kv_cache_memory"])
    w = measured["workload"]
    rows = []
    for m in measured["measured"]:
        c = m["concurrency"]
        wl = closed_loop(list(w["prompt_tokens"]), w["output_len"], c, w.get("name", "measured"), client_jitter_s)
        s = simulate(dep, wl, settings, seed).summary
        rows.append(ValidationRow(c, "output tok/s", s.output_tok_s, m["output_tok_s"]))
        rows.append(ValidationRow(c, "mean TTFT (s)", s.mean_ttft_s, m["mean_ttft_s"]))
        if "mean_latency_s" in m:
            rows.append(ValidationRow(c, "mean latency (s)", s.mean_latency_s, m["mean_latency_s"]))
    return rows


def validation_markdown(rows: list[ValidationRow]) -> str:
    out = ["| concurrency | metric | predicted | measured | error |", "|---|---|---|---|---|"]
    for r in rows:
        fmt = "{:.1f}" if "tok/s" in r.metric else "{:.2f}"
        out.append(f"| {r.concurrency} | {r.metric} | {fmt.format(r.predicted)} | {fmt.format(r.measured)} "
                   f"| {100 * r.error:+.1f}% |")
    return "\n".join(out)
