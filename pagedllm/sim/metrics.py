"""What a simulated run reports: per-request timings, and their summary in the units `bench serve` uses."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass(frozen=True)
class RequestRecord:
    arrival_s: float
    first_token_s: float
    finish_s: float
    prompt_len: int
    output_len: int
    cached_tokens: int = 0
    preemptions: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def latency(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for one-token outputs)."""
        return (self.finish_s - self.first_token_s) / (self.output_len - 1) if self.output_len > 1 else None


@dataclass
class Summary:
    system: str
    num_requests: int
    output_tokens: int
    duration_s: float
    output_tok_s: float
    mean_ttft_s: float
    p99_ttft_s: float
    mean_tpot_s: float
    p99_tpot_s: float
    mean_latency_s: float
    p99_latency_s: float
    num_devices: int
    price_per_device_hour: float
    cost_per_m_tokens: float  # $ per million output tokens at the device-hour price, devices busy for the run
    weights_bytes: float
    kv_pool_bytes: float
    kv_usage_max: float  # fraction of the KV pool held by requests
    kv_usage_mean: float  # time-weighted over the run
    preemptions: int = 0
    prefix_hit_rate: float = 0.0  # prompt tokens found in the prefix cache / prompt tokens looked up
    num_steps: int = 0
    prefill_tokens_computed: int = 0
    spec_mean_accepted: float | None = None  # accepted drafts per verify step
    state_pool_bytes: float = 0.0  # a hybrid model's recurrent-state slots (all devices and replicas)
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def stream_tok_s(self) -> float:
        """What one request's stream sees while decoding: 1 / mean TPOT."""
        return 1 / self.mean_tpot_s if self.mean_tpot_s > 0 else 0.0

    @property
    def memory_bytes(self) -> float:
        return self.weights_bytes + self.kv_pool_bytes + self.state_pool_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stream_tok_s"] = self.stream_tok_s
        d["memory_bytes"] = self.memory_bytes
        return d


def summarize(system: str, records: list[RequestRecord], start_s: float, end_s: float, num_devices: int,
              price: float, weights_bytes: float, kv_pool_bytes: float, **kw) -> Summary:
    duration = max(end_s - start_s, 1e-12)
    out = sum(r.output_len for r in records)
    tpots = [t for t in (r.tpot for r in records) if t is not None]
    cost = price * num_devices * duration / 3600 / (out / 1e6) if out else 0.0
    return Summary(
        system=system, num_requests=len(records), output_tokens=out, duration_s=duration, output_tok_s=out / duration,
        mean_ttft_s=mean([r.ttft for r in records]), p99_ttft_s=percentile([r.ttft for r in records], 99),
        mean_tpot_s=mean(tpots), p99_tpot_s=percentile(tpots, 99),
        mean_latency_s=mean([r.latency for r in records]), p99_latency_s=percentile([r.latency for r in records], 99),
        num_devices=num_devices, price_per_device_hour=price, cost_per_m_tokens=cost, weights_bytes=weights_bytes,
        kv_pool_bytes=kv_pool_bytes, **kw,
    )
