"""Benchmark metric math on per-request records (pure functions, unit-tested on hand-made timestamps).

Definitions (as vLLM's benchmark_serving):
- TTFT: first content chunk time - send time.
- TPOT: (latency - TTFT) / (output tokens - 1), for requests with more than one output token.
- ITL: the gaps between consecutive content chunks.
- E2EL: last chunk time - send time.
- goodput: requests/s that met every given SLO (ttft, tpot, e2el in milliseconds).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, end to end
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _stats(values: list[float], prefix: str, scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {f"mean_{prefix}_ms": 0.0, f"median_{prefix}_ms": 0.0, f"p90_{prefix}_ms": 0.0,
                f"p99_{prefix}_ms": 0.0}
    a = np.asarray(values, dtype=np.float64) * scale
    return {f"mean_{prefix}_ms": float(a.mean()), f"median_{prefix}_ms": float(np.median(a)),
            f"p90_{prefix}_ms": float(np.percentile(a, 90)), f"p99_{prefix}_ms": float(np.percentile(a, 99))}


def summarize(records: list[RequestRecord], duration: float, goodput_slo_ms: dict[str, float] | None = None) -> dict:
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    res: dict = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
    }
    res.update(_stats([r.ttft for r in ok], "ttft"))
    res.update(_stats([t for r in ok if (t := r.tpot) is not None], "tpot"))
    res.update(_stats([x for r in ok for x in r.itl], "itl"))
    res.update(_stats([r.latency for r in ok], "e2el"))
    if goodput_slo_ms:
        good = 0
        for r in ok:
            vals = {"ttft": r.ttft * 1000, "tpot": (r.tpot or 0.0) * 1000, "e2el": r.latency * 1000}
            if all(vals[k] <= v for k, v in goodput_slo_ms.items()):
                good += 1
        res["goodput"] = good / duration if duration > 0 else 0.0
        res["goodput_slo_ms"] = dict(goodput_slo_ms)
    errors = [r.error for r in records if not r.success]
    if errors:
        res["errors"] = errors[:10]
    return res


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0}."""
    if not items:
        return None
    out = {}
    for it in items:
        key, _, val = it.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not val:
            raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {it!r}")
        out[key] = float(val)
    return out


def records_to_json(records: list[RequestRecord]) -> list[dict]:
    return [asdict(r) for r in records]
