"""EngineCore: one step = schedule -> execute on the model runner -> update the scheduler with the results."""

from __future__ import annotations

import logging

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.outputs import EngineCoreOutput, SchedulerStats
from pagedllm.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.worker.model_runner import ModelRunner

        self.config = config
        self.runner = ModelRunner(config)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.arch.vocab_size
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        sc = config.scheduler
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({sc.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) with chunked prefill disabled: long prompts could never be scheduled"
            )
        self.scheduler = Scheduler(
            self.kv_cache_manager, sc.max_num_batched_tokens, sc.max_num_seqs, self.max_model_len,
            sc.enable_chunked_prefill,
        )
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        """Admission checks; a bad request raises ValueError and changes nothing."""
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError("the prompt is empty: at least one token is required")
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})")
        if n + request.max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + request.max_tokens} tokens ({n} in the prompt, {request.max_tokens} for the completion "
                f"(max_tokens)). Please reduce the length of the prompt or max_tokens."
            )
        request.sampling_params.check_vocab(self.vocab_size)
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: list[str]) -> list[str]:
        return [r.request_id for r in self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        so = self.scheduler.schedule()
        if so.is_empty:
            raise RuntimeError(f"scheduler made no progress: {self.scheduler.waiting[0]!r} cannot be scheduled")
        result = self.runner.execute(so)
        self.num_steps += 1
        return self.scheduler.update_from_output(so, result)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()
