"""One generation request as the core sees it (tier 0).

The scheduler's one rule: a request has ``all_token_ids`` (prompt + output) and ``num_computed_tokens``; each
step computes some of the tokens not computed yet. Chunked prefill, prefix-cache hits, preemption by recompute
and speculative rejections are all adjustments of ``num_computed_tokens``.
"""

from __future__ import annotations

import enum
import time

from pagedllm.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a request (one of its samples) ended; a ``str`` whose value is what the OpenAI API shows."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # the caller aborted it (or went away), or the server shut down
    ERROR = "error"  # the model runner failed on this request (RequestFailedError)
    OVERLOADED = "overloaded"  # dropped after waiting longer than its maximum queue delay (HTTP 503)

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class RequestStatus(enum.IntEnum):
    # Order is a contract: every status > PREEMPTED is finished.
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        max_tokens: int,
        arrival_time: float | None = None,
        priority: int = 0,
        max_queue_delay_ms: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens  # resolved (never None)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.max_queue_delay_ms = max_queue_delay_ms  # overrides the engine's limit for this request
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []  # draft tokens to verify in the next step (not in all_token_ids)
        self.prompt_logprobs: list = []  # SampledTokenLogprobs of prompt tokens 1.. computed so far
        self.host_block_ids: list[int] | None = None  # where its KV waits while swapped out
        self.host_state_slot: int | None = None  # where its recurrent state waits (a hybrid model)
        self.num_cached_tokens = -1  # prefix-cache hit of the first scheduling, in tokens (-1: not yet known)
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Timestamps for metrics (monotonic seconds).
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_whole_prompt(self) -> bool:
        """Its prompt must be computed here, not taken from the prefix cache: mean and cls pooling read rows from its
        start, and prompt logprobs need the rows of the prompt tokens whose logprobs are still missing."""
        sp = self.sampling_params
        return sp.pooling in ("mean", "cls") or (
            sp.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    def prompt_logprob_span(self, start: int, end: int) -> tuple[int, int] | None:
        """Rows at positions [start, end) computed now whose logprobs of the next prompt token are still missing."""
        if self.sampling_params.prompt_logprobs is None:
            return None
        lo, hi = max(start, len(self.prompt_logprobs)), min(end, self.num_prompt_tokens - 1)
        return (lo, hi) if lo < hi else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
