"""Every type that crosses a layer, as plain lists and ints (tier 0: stdlib only)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedllm.request import FinishReason
from pagedllm.sampling_params import SamplingParams


# ---------------------------------------------------------------- scheduler -> worker
@dataclass
class NewRequestData:
    """Sent once, the first step a request is scheduled: what the worker keeps for it until it finishes."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


@dataclass
class ScheduledRequest:
    """One request's work in one step: compute ``token_ids`` at positions ``num_computed_tokens`` onwards."""

    req_id: str
    token_ids: list[int]  # computed this step: a prefill chunk or the last sampled token, then any drafts
    num_computed_tokens: int  # position of token_ids[0]
    block_ids: list[list[int]]  # per KV layer group: the request's whole block table (lookahead slots included)
    sample: bool  # True when this chunk reaches the end of the request's tokens: sample the next one
    num_output_tokens: int  # output tokens the request has before this step (penalties, min_tokens)
    num_spec_tokens: int = 0  # the last num_spec_tokens of token_ids are draft tokens to verify
    # prompt logprobs: the rows at positions [start, end) give the logprob of the prompt token after each
    prompt_logprob_span: tuple[int, int] | None = None
    pooling: bool = False  # an embedding request: pool hidden states, sample nothing
    # a hybrid model's recurrent state (``core.state_pool``): the request's slot (-1: none), a snapshot slot
    # copied into it before the step (a prefix hit, -1: none), and a snapshot to save after state_save_rows
    # rows of this chunk into state_save_slot
    state_slot: int = -1
    state_restore: int = -1
    state_save_rows: int = 0
    state_save_slot: int = -1

    @property
    def spec_token_ids(self) -> list[int]:
        """The draft tokens this step verifies (the tail of ``token_ids``)."""
        return self.token_ids[len(self.token_ids) - self.num_spec_tokens :]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # the worker may drop their state
    num_batched_tokens: int = 0
    num_preemptions: int = 0
    speculate: bool = False  # lookahead slots were allocated: the worker may propose drafts for the next step
    # KV block copies done before the forward pass, swap-outs first: (device block, host block) pairs
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # a hybrid model's recurrent states, likewise: (device slot, host slot) out, (host slot, device slot) in
    state_swap_out: list[tuple[int, int]] = field(default_factory=list)
    state_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def has_swaps(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.state_swap_out or self.state_swap_in)


# ---------------------------------------------------------------- worker -> scheduler
@dataclass
class SampledTokenLogprobs:
    """Log-probability of the sampled token, its rank, and the top-k alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class ModelRunnerOutput:
    # req_id -> new tokens (accepted drafts + one sampled token), only for requests whose chunk had sample=True
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[SampledTokenLogprobs]] = field(default_factory=dict)
    # req_id -> draft tokens proposed for the next step
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> logprobs of the prompt tokens in its ``prompt_logprob_span`` (shifted by one), in order
    prompt_logprobs: dict[str, list[SampledTokenLogprobs]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # req_id -> its embedding (the last chunk)


# ---------------------------------------------------------------- core -> front end
@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampledTokenLogprobs] | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first scheduling; set on the first output
    # prompt tokens 1.. (token 0 has no logprob); set on the first output of a request that asked for them
    prompt_logprobs: list[SampledTokenLogprobs] | None = None
    pooled: list[float] | None = None  # an embedding request's vector (its only output)


@dataclass
class SchedulerCounters:
    """The scheduler's cumulative counters (fields of ``SchedulerStats`` too)."""

    num_preemptions: int = 0
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_swap_outs: int = 0  # requests swapped out / in
    num_swap_ins: int = 0
    swap_out_blocks: int = 0  # blocks copied
    swap_in_blocks: int = 0
    num_rejected: int = 0  # requests refused (queue full) or dropped (waited too long)


@dataclass
class SpecDecodeCounters:
    """Speculative decoding's cumulative counters (fields of ``SchedulerStats`` too)."""

    spec_num_drafts: int = 0  # verification steps
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # accepted drafts by position


@dataclass
class SchedulerStats(SpecDecodeCounters, SchedulerCounters):
    """The scheduler now: the gauges below, and the cumulative counters it inherits."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0  # KV blocks free now (cached ones included)
    num_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up, cumulative
    prefix_cache_hits: int = 0  # tokens found, cumulative
    num_batched_tokens: int = 0  # this step
    token_budget: int = 0  # the step budget in force (SLA mode adapts it)
    num_swapped: int = 0  # requests waiting with their KV in host memory
    # a hybrid model's recurrent-state slots (``core.state_pool``): all, held by running requests, keeping snapshots
    num_state_slots: int = 0
    num_state_slots_held: int = 0
    num_state_snapshots: int = 0


@dataclass
class FinishedRequestStats:
    finish_reason: FinishReason
    e2e_latency: float
    queue_time: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one engine step produced, for metrics (plain data; exported by the metrics layer)."""

    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of requests that got their first token this step
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    # the prefix cache's changes since the last step, in order (only with enable_kv_cache_events)
    kv_events: list[KVBlockStored | KVBlockRemoved] = field(default_factory=list)


@dataclass(frozen=True)
class KVBlockStored:
    """A full block's K/V entered the prefix cache: its chained hash (``core.block_pool.hash_block_tokens``), its
    parent's (None: the first block of a prompt) and its tokens."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVBlockRemoved:
    """A block's content left the prefix cache (its block was reused for other tokens)."""

    block_hash: bytes


# ---------------------------------------------------------------- front end -> user
@dataclass
class Logprob:
    token_id: int
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int
    decoded_token: str
    top: list[Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() seconds
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # per prompt token (None for the first one): its logprob after the tokens before it, with top alternatives
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None  # an embedding request's pooled hidden state (not normalised)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV cache's shape as the engine allocated it (the server's metrics and /debug read it)."""
    num_blocks: int
    block_size: int
    bytes_per_block: int
    total_bytes: int
    num_groups: int = 1  # KV layer groups: a token takes a block place in each

    @property
    def num_tokens(self) -> int:
        """Tokens the cache holds (of sequences within the sliding windows)."""
        return self.num_blocks * self.block_size // self.num_groups

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block * self.num_groups // self.block_size


def l2_normalize(vec: list[float]) -> list[float]:
    """``vec`` scaled to unit length (an all-zero vector stays zero)."""
    norm = math.sqrt(sum(x * x for x in vec))
    return [x / norm for x in vec] if norm > 0 else list(vec)
