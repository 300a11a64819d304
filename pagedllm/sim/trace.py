"""Request traces: Poisson arrivals, a burst at t=0, closed-loop clients, a recorded trace (JSON), and W1.

A trace is a tuple of requests (arrival time, prompt length, output length, the length of a prefix shared with
other requests of the same group); ``Workload`` adds how they arrive: at their arrival times (open loop), or
from ``concurrency`` clients that each send the next request when their previous one finishes (closed loop,
what ``pagedllm bench serve --max-concurrency C`` does).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    shared_prefix_len: int = 0  # leading prompt tokens identical across requests of the same prefix_group
    prefix_group: int = 0

    def __post_init__(self) -> None:
        if self.arrival_s < 0:
            raise ValueError(f"arrival time must be >= 0, got {self.arrival_s}")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"prompt and output lengths must be >= 1, got {self.prompt_len}, {self.output_len}")
        if not 0 <= self.shared_prefix_len <= self.prompt_len:
            raise ValueError(f"shared_prefix_len must be in [0, prompt_len], got {self.shared_prefix_len}")


@dataclass(frozen=True)
class Workload:
    requests: tuple[TraceRequest, ...]
    concurrency: int | None = None  # closed loop with this many clients; None: open loop at the arrival times
    name: str = "trace"
    # closed loop: each client sends its next request uniform(0, client_jitter_s) after its previous one finished
    # (and its first one that long after t=0): a real client's turnaround, so requests that finish in the same
    # step do not all arrive together
    client_jitter_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("a workload needs at least one request")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.client_jitter_s < 0:
            raise ValueError(f"client_jitter_s must be >= 0, got {self.client_jitter_s}")
        object.__setattr__(self, "requests", tuple(self.requests))

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def describe(self) -> str:
        n = len(self.requests)
        p = [r.prompt_len for r in self.requests]
        o = [r.output_len for r in self.requests]
        shared = max(r.shared_prefix_len for r in self.requests)
        clients = f"{self.concurrency} client{'s' if (self.concurrency or 0) > 1 else ''}"
        how = (f"closed loop, {clients}" if self.concurrency is not None
               else ("all at t=0" if all(r.arrival_s == 0 for r in self.requests)
                     else f"open loop over {self.requests[-1].arrival_s:.1f} s"))
        s = (f"{self.name}: {n} requests, prompts {min(p)}-{max(p)} tokens (mean {sum(p) / n:.0f}), outputs "
             f"{min(o)}-{max(o)} (mean {sum(o) / n:.0f}), {how}")
        groups = len({r.prefix_group for r in self.requests if r.shared_prefix_len})
        if not shared:
            return s
        return s + (f", {shared}-token shared prefix" if groups <= 1 else f", {groups} {shared}-token shared prefixes")


@dataclass(frozen=True)
class LengthDist:
    """Lengths drawn uniformly from [low, high] (low == high: fixed)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got {self.low}, {self.high}")

    @staticmethod
    def parse(text: str) -> "LengthDist":
        """``N`` or ``LOW-HIGH``."""
        try:
            if "-" in text:
                lo, hi = text.split("-", 1)
                return LengthDist(int(lo), int(hi))
            return LengthDist(int(text), int(text))
        except ValueError as e:
            raise ValueError(f"a length is N or LOW-HIGH, got {text!r} ({e})") from None

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)


def synthetic(num_requests: int, prompt: LengthDist, output: LengthDist, rate: float | None = None,
              concurrency: int | None = None, shared_prefix_len: int = 0, seed: int = 0,
              num_prefixes: int = 1) -> Workload:
    """Poisson arrivals at ``rate`` requests/s (exponential gaps), or all at t=0 when rate is None or inf;
    ``shared_prefix_len`` tokens (e.g. a system prompt) are prepended to every prompt: one of ``num_prefixes``
    different ones, drawn at random per request (bench serve's prefix-repeat dataset with --num-prefixes)."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    if num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    t = 0.0
    reqs = []
    for _ in range(num_requests):
        group = rng.randrange(num_prefixes) if num_prefixes > 1 else 0
        reqs.append(TraceRequest(t if concurrency is None else 0.0, shared_prefix_len + prompt.sample(rng),
                                 output.sample(rng), shared_prefix_len, group))
        if rate is not None and rate != float("inf"):
            t += rng.expovariate(rate)
    name = "poisson" if rate not in (None, float("inf")) and concurrency is None else "synthetic"
    return Workload(tuple(reqs), concurrency, name)


def with_shared_prefix(w: Workload, shared_prefix_len: int) -> Workload:
    """The same requests with a shared prefix of this many tokens prepended (0: unchanged)."""
    if shared_prefix_len <= 0:
        return w
    reqs = tuple(TraceRequest(r.arrival_s, r.prompt_len + shared_prefix_len, r.output_len,
                              r.shared_prefix_len + shared_prefix_len, r.prefix_group) for r in w.requests)
    return Workload(reqs, w.concurrency, w.name)


def closed_loop(prompt_lens: list[int], output_len: int, concurrency: int, name: str = "closed loop",
                client_jitter_s: float = 0.0) -> Workload:
    return Workload(tuple(TraceRequest(0.0, p, output_len) for p in prompt_lens), concurrency, name, client_jitter_s)


def load_trace(path: str, concurrency: int | None = None) -> Workload:
    """A recorded trace: ``{"requests": [{"arrival_s", "prompt_len", "output_len", "shared_prefix_len"?,
    "prefix_group"?}, ...]}`` (or a bare list). ``pagedllm bench serve`` result files are accepted too: their
    ``prompt_tokens`` / ``output_tokens`` give the lengths (arrivals at t=0; give a concurrency)."""
    with open(path) as f:
        data = json.load(f)
    items = data["requests"] if isinstance(data, dict) else data
    reqs = []
    for i, r in enumerate(items):
        try:
            if "prompt_len" in r:
                reqs.append(TraceRequest(float(r.get("arrival_s", 0.0)), int(r["prompt_len"]), int(r["output_len"]),
                                         int(r.get("shared_prefix_len", 0)), int(r.get("prefix_group", 0))))
            else:
                reqs.append(TraceRequest(0.0, int(r["prompt_tokens"]), int(r["output_tokens"])))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: request {i} is not a trace entry ({e})") from None
    reqs.sort(key=lambda r: r.arrival_s)
    return Workload(tuple(reqs), concurrency, f"trace {path}")


def save_trace(w: Workload, path: str) -> None:
    with open(path, "w") as f:
        json.dump({"requests": [r.__dict__ for r in w.requests]}, f, indent=1)


# The W1 workload of `pagedllm bench compare` / `bench serve`: the first 32 shipped prompts
# (pagedllm/bench/data/prompts.jsonl), as tokenized by the default model (prompt_tokens reported by the server,
# in dataset order), 128 output tokens each, EOS ignored.
W1_PROMPT_TOKENS = (120, 150, 133, 128, 113, 113, 188, 120, 111, 170, 125, 123, 117, 125, 123, 115, 111, 126, 190,
                    109, 114, 118, 124, 118, 116, 125, 132, 141, 110, 145, 127, 125)
W1_OUTPUT_LEN = 128


def w1(concurrency: int | None = 32, client_jitter_s: float = 0.0, output_len: int = W1_OUTPUT_LEN) -> Workload:
    return closed_loop(list(W1_PROMPT_TOKENS), output_len, concurrency or len(W1_PROMPT_TOKENS), "W1",
                       client_jitter_s)
