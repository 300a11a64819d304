"""EngineCore: one step = schedule -> execute on the model runner -> update the scheduler with the results."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.errors import EngineFatalError
from pagedllm.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from pagedllm.request import FinishReason, Request, RequestStatus

logger = logging.getLogger(__name__)


class EngineCore:
    """The scheduler and the model runner it drives. ``runner`` is built by the caller (``LLMEngine`` makes a
    ``ModelRunner``; a test may hand in a fake one): it gives ``max_model_len``, ``arch.vocab_size``,
    ``num_blocks``, ``num_host_blocks``, ``execute(SchedulerOutput) -> ModelRunnerOutput`` and ``shutdown()``.
    ``config`` is the engine's, with the step token budget set when it was left to the default."""

    def __init__(self, config: EngineConfig, runner) -> None:
        self.runner = runner
        self.encoder = getattr(runner.arch, "encoder", False)
        if self.encoder:  # an embedding model: each text computed whole in one step, nothing cached for later
            config = dataclasses.replace(
                config, cache=dataclasses.replace(config.cache, enable_prefix_caching=False),
                scheduler=dataclasses.replace(config.scheduler, enable_chunked_prefill=False))
        self.max_model_len = runner.max_model_len
        self.vocab_size = runner.arch.vocab_size
        self.kv_cache_manager = KVCacheManager(
            runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            windows=getattr(runner, "kv_group_windows", (0,)),  # a test's fake runner: one full-attention group
            record_events=config.cache.enable_kv_cache_events,
            num_state_slots=getattr(runner, "num_state_slots", 0),  # a hybrid model's recurrent-state slots
            state_live_slots=getattr(runner, "state_live_slots", 0) or config.scheduler.max_num_seqs,
            # an MTP module's K/V at a position read the token after it
            shifted_kv=config.speculative is not None and config.speculative.method == "mtp",
        )
        self.scheduler = Scheduler.from_config(config, self.kv_cache_manager, self.max_model_len,
                                               num_host_blocks=runner.num_host_blocks,
                                               num_host_state_slots=getattr(runner, "num_host_state_slots", 0))
        sc = self.scheduler.config  # the step budget set when it was left to the default
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({sc.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) with chunked prefill disabled: long prompts could never be scheduled"
            )
        logger.info("scheduler: %d tokens per step (%s), at most %d sequences%s", sc.max_num_batched_tokens,
                    "default" if config.scheduler.max_num_batched_tokens is None else "given", sc.max_num_seqs,
                    ", SLA mode" if sc.sla_mode else "")
        self.config = dataclasses.replace(config, scheduler=sc)
        self.num_steps = 0
        # entered around the model runner's forward pass; AsyncLLM uses it to release its lock meanwhile, so the
        # event loop can queue requests and read stats while the step computes
        self.forward_section = contextlib.nullcontext
        self.fatal_error: EngineFatalError | None = None  # once set, the engine steps no more

    def check_prompt_token_ids(self, ids: list[int]) -> None:
        """The one check of a prompt (ValueError, naming what is wrong): at least one token, every id a token of
        this model's vocabulary, and shorter than the context length. Run before anything turns the ids into C
        integers (a negative or 2^70 id would raise OverflowError there, not this message)."""
        bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range [0, {self.vocab_size})")
        if not ids:
            raise ValueError("the prompt is empty: at least one token is required")
        if self.encoder and len(ids) > self.max_model_len:  # an embedding model reads its whole context
            raise ValueError(
                f"This model's maximum input length is {self.max_model_len} tokens. However, your input has "
                f"{len(ids)} tokens. Shorten it, or pass truncate_prompt_tokens (-1: the model's maximum).")
        if not self.encoder and len(ids) >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"{len(ids)} tokens; it must be shorter than the context length."
            )

    def add_request(self, request: Request) -> None:
        """Admission checks of the request (its prompt passed check_prompt_token_ids before the request was
        made): the prompt and max_tokens fit the context, the sampling parameters fit the vocabulary. A bad
        request raises ValueError and changes nothing."""
        n = request.num_prompt_tokens
        if self.encoder and not request.sampling_params.pooling:
            raise ValueError("this is an embedding model: it computes vectors (/v1/embeddings), not text")
        if not self.encoder and n + request.max_tokens > self.max_model_len:
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
        if self.fatal_error is not None:  # the scheduler's state is mid-step; nothing may run any more
            raise self.fatal_error
        if not self.scheduler.has_unfinished_requests():
            return []
        t0 = time.perf_counter()  # SLA mode times the whole step: scheduling, forward pass, bookkeeping
        so = self.scheduler.schedule()
        if so.is_empty:
            raise RuntimeError(f"scheduler made no progress: {self.scheduler.waiting.peek()!r} cannot be scheduled")
        failed: dict[str, str] = {}
        try:
            with self.forward_section():
                result = self.runner.execute(so)
        except EngineFatalError as e:  # e.g. a tensor-parallel worker died: nothing to isolate, the engine stops
            self.fatal_error = e
            raise
        except Exception as e:  # find the request(s) that fail; the others go on
            logger.warning("step failed (%s: %s); re-running its requests one at a time", type(e).__name__, e)
            if self.kv_cache_manager.states is not None:  # the failed step may have half-written its snapshots
                self.kv_cache_manager.discard_pending_snapshots()
            result, failed = self._execute_isolated(so)
            t0 = None  # a step re-run request by request is no sample of the step-time model
        self.num_steps += 1
        outputs = self.scheduler.update_from_output(so, result)
        if t0 is not None:
            self.scheduler.observe_step_time(so.num_batched_tokens, time.perf_counter() - t0)
        for rid, msg in failed.items():
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self.kv_cache_manager.uncache_private_blocks(req)
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            outputs.append(EngineCoreOutput(rid, [], None, finish_reason=FinishReason.ERROR, stop_reason=msg))
        if not self.scheduler.has_unfinished_requests():
            self.runner.went_idle()
        return outputs

    def _execute_isolated(self, so: SchedulerOutput) -> tuple[ModelRunnerOutput, dict[str, str]]:
        merged = ModelRunnerOutput()
        failed: dict[str, str] = {}
        for s in so.scheduled:
            if s.state_slot >= 0:
                # a recurrent state the failed step may already have advanced (K/V rewrites are idempotent, a
                # state update is not): the request's whole context again, from its first token and a zeroed state
                req = self.scheduler.requests[s.req_id]
                end = s.num_computed_tokens + len(s.token_ids)
                s = dataclasses.replace(s, token_ids=req.all_token_ids[:end], num_computed_tokens=0, state_restore=-1,
                                        state_save_rows=0, state_save_slot=-1)
            try:
                r = self.runner.execute(SchedulerOutput(scheduled=[s], num_batched_tokens=len(s.token_ids)))
            except EngineFatalError as e:
                self.fatal_error = e
                raise
            except Exception as e:
                logger.exception("request %s failed in the model runner", s.req_id)
                failed[s.req_id] = f"{type(e).__name__}: {e}"
                continue
            merged.sampled_token_ids.update(r.sampled_token_ids)
            merged.logprobs.update(r.logprobs)
            merged.spec_token_ids.update(r.spec_token_ids)
        return merged, failed

    # ------------------------------------------------------------------ what the engine may ask
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def running_request_ids(self) -> list[str]:
        """The core requests running now (the ones a step computes)."""
        return [r.request_id for r in self.scheduler.running]

    def kv_state(self) -> dict:
        """The KV block pools now (see Scheduler.kv_state)."""
        return self.scheduler.kv_state()

    def shutdown(self) -> None:
        """Stop the model runner's other ranks (tensor parallelism); a no-op otherwise."""
        self.runner.shutdown()
