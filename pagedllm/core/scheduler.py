"""Iteration-level continuous batching. Pure Python, no torch.

Every step, each scheduled request computes some of the tokens it has not computed yet
(``num_computed_tokens`` catching up with ``all_token_ids``), within the step's token budget. Running requests go
first (decodes and unfinished prefill chunks), then waiting ones fill what budget and sequence slots remain.
When blocks run out, the latest-arrived running request is preempted by recompute: its blocks are freed,
``num_computed_tokens`` returns to 0, and it goes back to the front of the queue.
"""

from __future__ import annotations

import dataclasses
import time
from itertools import islice

from pagedllm.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedllm.core.block_pool import HostBlockPool
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request_queue import make_queue
from pagedllm.core.sla import BudgetController, QueuedPrefill
from pagedllm.errors import EngineOverloadedError
from pagedllm.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerCounters,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodeCounters,
)
from pagedllm.request import FinishReason, Request, RequestStatus


class Scheduler:
    """Built from the engine's config objects: ``scheduler_config`` (budget, sequence slots, policy, queue limits,
    SLA targets) and ``cache_config`` (preemption mode; its block size must be the KV cache manager's)."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        *,
        num_lookahead_slots: int = 0,
        spec_disable_by_batch_size: int | None = None,
        num_host_blocks: int = 0,
        num_host_state_slots: int = 0,
        budget_controller: BudgetController | None = None,
    ) -> None:
        if kv_cache_manager.block_size != cache_config.block_size:
            raise ValueError(f"the KV cache manager's block size ({kv_cache_manager.block_size}) is not the cache "
                             f"config's ({cache_config.block_size})")
        scheduler_config = scheduler_config.with_budget_for(max_model_len)  # the default budget when unset
        self.config = scheduler_config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        # SLA mode: the step budget follows measured step times (a test may hand in its own controller)
        if budget_controller is None:
            budget_controller = BudgetController.from_config(scheduler_config)
        self.budget_controller = budget_controller
        self.swap_on_preempt = cache_config.preemption_mode == "swap"
        self.host_pool = HostBlockPool(num_host_blocks)
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._host_release: list[int] = []  # host blocks read by the last step's swap-ins: free from the next
        # a hybrid model's recurrent states swap with their KV: host slots, and the slot copies of this step
        self.host_states = HostBlockPool(num_host_state_slots)
        self._state_swap_out: list[tuple[int, int]] = []
        self._state_swap_in: list[tuple[int, int]] = []
        self._host_state_release: list[int] = []
        self._rejected: list[EngineCoreOutput] = []  # requests dropped for waiting too long, reported next update
        self.num_lookahead_slots = num_lookahead_slots  # > 0 when speculative decoding is on
        self.spec_disable_by_batch_size = spec_disable_by_batch_size
        self.counters = SchedulerCounters()
        self.spec_counters = SpecDecodeCounters()
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self._sent_to_worker: set[str] = set()
        self._finished_req_ids: list[str] = []
        self.last_step_tokens = 0
        self._step_shape: tuple[int, int, int] | None = None  # (tokens, sequences, context) of the last step
        self.clock = time.monotonic  # arrival times are on this clock (a simulation may swap it)

    @classmethod
    def from_config(cls, config: EngineConfig, kv_cache_manager: KVCacheManager, max_model_len: int,
                    num_host_blocks: int = 0, num_host_state_slots: int = 0) -> "Scheduler":
        """The engine's scheduler: speculative decoding's lookahead from ``config.speculative``."""
        spec = config.speculative
        return cls(config.scheduler, config.cache, kv_cache_manager, max_model_len,
                   num_lookahead_slots=spec.num_lookahead_slots if spec else 0,
                   spec_disable_by_batch_size=spec.disable_by_batch_size if spec else None,
                   num_host_blocks=num_host_blocks, num_host_state_slots=num_host_state_slots)

    # ------------------------------------------------------------------ requests in / out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.waiting) >= limit:
            self.counters.num_rejected += 1
            raise EngineOverloadedError(
                f"the waiting queue is full ({limit} requests): retry later", 429, retry_after=1.0
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, req_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """Finish (e.g. abort) requests wherever they are; frees their blocks at once."""
        done = []
        for rid in [req_ids] if isinstance(req_ids, str) else req_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            done.append(req)
        return done

    def _free(self, req: Request) -> None:
        if req.host_block_ids is not None:  # aborted while swapped out (its swap-out copy already ran)
            self.host_pool.release(req.host_block_ids)
            req.host_block_ids = None
        if req.host_state_slot is not None:
            self.host_states.release([req.host_state_slot])
            req.host_state_slot = None
        self.kv.free(req)
        self.kv.forget(req)
        del self.requests[req.request_id]
        if req.request_id in self._sent_to_worker:
            self._sent_to_worker.discard(req.request_id)
            self._finished_req_ids.append(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def _expire_waiting(self, now: float) -> None:
        """Drop never-scheduled requests that waited longer than their maximum queue delay."""
        expired = []
        for req in self.waiting:
            limit = req.max_queue_delay_ms if req.max_queue_delay_ms is not None else self.config.max_queue_delay_ms
            if limit is not None and req.first_scheduled_time is None and (now - req.arrival_time) * 1000 > limit:
                expired.append((req, limit))
        for req, limit in expired:
            self.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
            self.counters.num_rejected += 1
            self._rejected.append(EngineCoreOutput(
                req.request_id, [], None, finish_reason=FinishReason.OVERLOADED,
                stop_reason=f"the request waited more than its maximum queue delay ({limit:g} ms)",
            ))

    def _preempt_for_priority(self) -> int:
        """Priority policy: free blocks for the best waiting request by preempting worse-priority running ones
        (before anything is scheduled this step, so no victim has work in flight)."""
        if not self.waiting or not self.running:
            return 0
        cand = self.waiting.peek()
        need = self.kv.blocks_needed(cand.num_tokens + self.num_lookahead_slots)
        n = 0
        while (self.kv.pool.num_free_blocks < need or len(self.running) >= self.config.max_num_seqs) and self.running:
            worst = self.running[-1]
            if (worst.priority, worst.arrival_time) <= (cand.priority, cand.arrival_time):
                break
            self.running.pop()
            self._preempt(worst)
            n += 1
        return n

    @property
    def token_budget(self) -> int:
        if self.budget_controller is not None:
            return self.budget_controller.budget()
        return self.config.max_num_batched_tokens

    def observe_step_time(self, num_tokens: int, seconds: float) -> None:
        """SLA mode: the measured duration of the step last scheduled (``num_tokens`` tokens)."""
        if self.budget_controller is not None:
            shape = self._step_shape
            seqs, ctx = (shape[1], shape[2]) if shape is not None and shape[0] == num_tokens else (1, 0)
            self.budget_controller.observe(num_tokens, seconds, seqs, ctx)

    def _plan_budget(self) -> tuple[int, int | None]:
        """SLA mode: this step's token budget and cap on new prefills, from the decodes and the prefill queue."""
        ctrl = self.budget_controller
        now = self.clock()
        num_decodes = decode_tokens = decode_context = 0
        min_gaps: int | None = None  # the fewest inter-token gaps of a decoding request (its TPOT averages them)
        queue: list[QueuedPrefill] = []
        for req in self.running:
            left = req.num_tokens - req.num_computed_tokens
            if left <= 1:
                num_decodes += 1
                decode_tokens += 1 + len(req.spec_token_ids)
                decode_context += req.num_tokens
                gaps = req.max_tokens - 1
                min_gaps = gaps if min_gaps is None else min(min_gaps, gaps)
            else:  # an unfinished chunked prefill: scheduled before any waiting request
                age = 0.0 if req.first_token_time is not None else now - req.arrival_time
                queue.append(QueuedPrefill(left, age, req.num_computed_tokens, False))
        for req in islice(self.waiting, ctrl.horizon):  # a preempted request that had its first token: its wait
            age = 0.0 if req.first_token_time is not None else now - req.arrival_time  # counts from now
            queue.append(QueuedPrefill(max(req.num_tokens - req.num_computed_tokens, 1), age, req.num_computed_tokens))
        budget = ctrl.plan(num_decodes, decode_tokens, decode_context, queue, min_gaps)
        if not self.config.enable_chunked_prefill and queue and not self.running:  # prompts go whole: never stall
            budget = max(budget, min(queue[0].tokens, self.config.max_num_batched_tokens))
        return budget, ctrl.max_new_prefills

    def _lookahead_slots(self) -> int:
        """KV slots beyond its tokens that each request scheduled this step gets: the speculative lookahead, or 0
        when speculation is off (or paused: at least ``spec_disable_by_batch_size`` requests run)."""
        limit = self.spec_disable_by_batch_size
        if limit is not None and len(self.running) >= limit:
            return 0
        return self.num_lookahead_slots

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: list[tuple[Request, int, list[int]]] = []  # (request, new tokens, draft tokens)
        preempted_now = 0
        if self._host_release:
            self.host_pool.release(self._host_release)
            self._host_release = []
        if self._host_state_release:
            self.host_states.release(self._host_state_release)
            self._host_state_release = []
        if self.kv.states is not None:
            self.kv.commit_snapshots()  # the last step's state snapshots are written now
        if self.waiting:
            self._expire_waiting(self.clock())
        if self.config.policy == "priority":
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))  # victims come from the tail
            preempted_for_priority = self._preempt_for_priority()
        else:
            preempted_for_priority = 0
        max_new: int | None = None  # cap on requests started from the queue this step (SLA mode)
        if self.budget_controller is not None and (self.running or self.waiting):
            step_budget, max_new = self._plan_budget()
        else:
            step_budget = self.token_budget
        budget = step_budget
        num_new_started = 0
        lookahead = self._lookahead_slots()
        speculate = lookahead > 0

        # 1. Running requests, oldest first; victims are taken from the tail, which is not scheduled yet.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            num_new = min(num_new, self.max_model_len - req.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            spec = req.spec_token_ids if speculate and num_new == req.num_tokens - req.num_computed_tokens else []
            # drafts fit in the budget, the context, and the output tokens left (one goes to the sampled token)
            room = min(budget - num_new, self.max_model_len - req.num_computed_tokens - num_new - 1,
                       req.max_tokens - req.num_output_tokens - 1)
            spec = spec[: max(room, 0)]
            while True:
                if self.kv.allocate_slots(req, num_new, num_lookahead_tokens=lookahead) is not None:
                    scheduled.append((req, num_new, spec))
                    budget -= num_new + len(spec)
                    i += 1
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted_now += 1
                if victim is req:
                    break

        # 2. Waiting requests, in order, while budget, sequence slots and blocks last (none after a preemption).
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted_now:
            if max_new is not None and num_new_started >= max_new:
                break
            num_new_started += 1  # counted even if it does not start: the loop ends then anyway
            req = self.waiting.peek()
            num_new = self._admit(req, budget, lookahead)
            if num_new is None:
                break
            scheduled.append((req, num_new, []))
            budget -= num_new

        # 3. Build the step's work; advance num_computed_tokens now (the worker computes exactly this).
        for req, num_new, spec in scheduled:
            req.spec_token_ids = []
            start = req.num_computed_tokens
            if req.request_id not in self._sent_to_worker:
                self._sent_to_worker.add(req.request_id)
                out.new_requests.append(NewRequestData(req.request_id, req.prompt_token_ids, req.sampling_params))
            end = start + num_new
            slot, restore, save_rows, save_slot = self.kv.take_state_ops(req.request_id)
            out.scheduled.append(
                ScheduledRequest(
                    req_id=req.request_id,
                    token_ids=req.all_token_ids[start:end] + spec,
                    num_computed_tokens=start,
                    block_ids=self.kv.get_block_ids(req.request_id),
                    sample=end == req.num_tokens,
                    num_output_tokens=req.num_output_tokens,
                    num_spec_tokens=len(spec),
                    prompt_logprob_span=req.prompt_logprob_span(start, end),
                    pooling=req.sampling_params.pooling is not None,
                    state_slot=slot, state_restore=restore, state_save_rows=save_rows, state_save_slot=save_slot,
                )
            )
            req.num_computed_tokens = end + len(spec)  # rejected drafts are taken back in update_from_output
        out.num_batched_tokens = step_budget - budget
        self._step_shape = (out.num_batched_tokens, len(out.scheduled),
                            sum(s.num_computed_tokens + len(s.token_ids) for s in out.scheduled))
        out.num_preemptions = preempted_now + preempted_for_priority
        out.speculate = speculate
        out.swap_out, out.swap_in = self._swap_out, self._swap_in
        self._swap_out, self._swap_in = [], []
        out.state_swap_out, out.state_swap_in = self._state_swap_out, self._state_swap_in
        self._state_swap_out, self._state_swap_in = [], []
        out.finished_req_ids = self._finished_req_ids
        self._finished_req_ids = []
        self.last_step_tokens = out.num_batched_tokens
        return out

    def _admit(self, req: Request, budget: int, lookahead: int) -> int | None:
        """Start the queue's head ``req`` within ``budget`` tokens: a swapped-out request gets its KV back (copied
        in before the forward pass), any other one takes its prefix-cache hits and computes the rest. Returns the
        tokens it computes this step, or None (nothing changed) when it does not fit."""
        swapped = req.host_block_ids is not None
        if swapped:
            hits, num_computed = [], req.num_computed_tokens
        elif req.needs_whole_prompt:
            hits, num_computed = [], 0
        else:
            hits, num_computed = self.kv.get_computed_blocks(req)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
        num_new = req.num_tokens - num_computed
        if num_new > budget and not self.config.enable_chunked_prefill:
            return None
        num_new = min(num_new, budget)
        if self.kv.allocate_slots(req, num_new, hits, num_lookahead_tokens=lookahead) is None:
            return None
        self.waiting.pop()
        if swapped:
            host = req.host_block_ids
            dev = self.kv.computed_block_ids(req.request_id, req.num_computed_tokens)
            assert len(dev) == len(host), (len(dev), len(host))
            self._swap_in.extend(zip(host, dev))
            self._host_release.extend(host)
            req.host_block_ids = None
            if req.host_state_slot is not None:  # its recurrent state back into the slot it was just given
                self._state_swap_in.append((req.host_state_slot, self.kv.states.owner[req.request_id]))
                self._host_state_release.append(req.host_state_slot)
                req.host_state_slot = None
            self.counters.num_swap_ins += 1
            self.counters.swap_in_blocks += len(host)
        else:
            self.kv.record_prefix_lookup(req.num_tokens, num_computed)
            req.num_computed_tokens = num_computed
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.clock()
        self.running.append(req)
        return num_new

    def _preempt(self, req: Request) -> None:
        req.status = RequestStatus.PREEMPTED
        req.spec_token_ids = []
        computed = self.kv.computed_block_ids(req.request_id, req.num_computed_tokens)
        n_blocks = len(computed)
        c = self.counters
        states = self.kv.states
        slot = states.owner.get(req.request_id) if states is not None else None
        if self.swap_on_preempt and 0 < n_blocks <= self.host_pool.num_free and (
                slot is None or self.host_states.num_free):
            # the copies run before this step's forward pass, so the freed device blocks can be reused at once
            if slot is not None:  # a hybrid model: the recurrent state goes with the KV
                req.host_state_slot = self.host_states.take(1)[0]
                self._state_swap_out.append((slot, req.host_state_slot))
            host = self.host_pool.take(n_blocks)
            self._swap_out.extend(zip(computed, host))
            req.host_block_ids = host
            c.num_swap_outs += 1
            c.swap_out_blocks += n_blocks
            c.num_preemptions_swap += 1
        else:
            req.num_computed_tokens = 0  # recompute
            c.num_preemptions_recompute += 1
        self.kv.free(req)
        req.num_preemptions += 1
        c.num_preemptions += 1
        self.waiting.prepend(req)

    # ------------------------------------------------------------------ results of one step
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = self._rejected
        self._rejected = []
        now = self.clock()
        for s in sched.scheduled:
            req = self.requests.get(s.req_id)
            if req is None or req.is_finished():
                continue  # aborted while the step ran
            if s.prompt_logprob_span is not None:
                req.prompt_logprobs.extend(result.prompt_logprobs.get(s.req_id, ()))
            if s.pooling:
                if s.sample:
                    outputs.append(self._finish_pooled(req, result.pooled[s.req_id], now))
                continue
            tokens = result.sampled_token_ids.get(s.req_id)
            if not tokens:
                continue  # a prefill chunk that did not reach the end
            if s.num_spec_tokens:
                accepted = len(tokens) - 1
                req.num_computed_tokens -= s.num_spec_tokens - accepted  # roll back the rejected drafts
                self._record_spec(s.num_spec_tokens, accepted)
            queue_time = None
            if req.first_token_time is None:
                req.first_token_time = now
                queue_time = (req.first_scheduled_time or now) - req.arrival_time
            lps = result.logprobs.get(s.req_id)
            status = None
            n_kept = 0
            for tok in tokens:
                req.append_output_token(tok)
                n_kept += 1
                status = self._check_stop(req, tok)
                if status is not None:
                    break
            out = EngineCoreOutput(
                req_id=req.request_id,
                new_token_ids=tokens[:n_kept],
                new_logprobs=lps[:n_kept] if lps is not None else None,
                finish_reason=None,
                num_cached_tokens=max(req.num_cached_tokens, 0),
                queue_time=queue_time,
                prompt_logprobs=list(req.prompt_logprobs) if queue_time is not None and
                req.sampling_params.prompt_logprobs is not None else None,
            )
            if status is not None:
                self.running.remove(req)
                req.status = status
                out.finish_reason = RequestStatus.finish_reason(status)
                out.stop_reason = req.stop_reason
                self._free(req)
            else:
                req.spec_token_ids = list(result.spec_token_ids.get(s.req_id, ()))
            outputs.append(out)
        return outputs

    def _finish_pooled(self, req: Request, vector: list[float], now: float) -> EngineCoreOutput:
        """An embedding request ends with its last prompt chunk: its vector is its one output."""
        req.first_token_time = now
        self.running.remove(req)
        req.status = RequestStatus.FINISHED_STOPPED
        self._free(req)
        return EngineCoreOutput(req.request_id, [], None, RequestStatus.finish_reason(req.status),
                                num_cached_tokens=max(req.num_cached_tokens, 0),
                                queue_time=(req.first_scheduled_time or now) - req.arrival_time, pooled=vector)

    def _record_spec(self, num_drafts: int, num_accepted: int) -> None:
        """One verification of ``num_drafts`` drafts, of which the first ``num_accepted`` were accepted."""
        c = self.spec_counters
        c.spec_num_drafts += 1
        c.spec_num_draft_tokens += num_drafts
        c.spec_num_accepted_tokens += num_accepted
        while len(c.spec_accepted_per_pos) < num_drafts:
            c.spec_accepted_per_pos.append(0)
        for i in range(num_accepted):
            c.spec_accepted_per_pos[i] += 1

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if token == req.eos_token_id and not sp.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    # ------------------------------------------------------------------ stats
    @property
    def num_swapped(self) -> int:
        """Waiting requests whose KV is in host memory."""
        return sum(1 for r in self.waiting if r.host_block_ids is not None)

    def kv_state(self) -> dict:
        """The device and host block pools now, and whether their bookkeeping agrees (leak checks)."""
        pool = self.kv.pool
        problem = None
        try:
            self.kv.check_integrity()  # block references == blocks held by requests; the free queue in sync
            if not self.running and not any(r.request_id in self.kv.req_to_blocks for r in self.waiting):
                assert pool.num_free_blocks == pool.num_blocks, (
                    f"no request holds blocks but {pool.num_blocks - pool.num_free_blocks} are not free")
            if not self.num_swapped:
                assert self.host_states.num_free == self.host_states.num_blocks or self._host_state_release, (
                    "no request is swapped out but host state slots are taken")
                assert self.host_pool.num_free == self.host_pool.num_blocks or self._host_release, (
                    "no request is swapped out but host blocks are taken")
        except AssertionError as e:
            problem = str(e)
        return {"num_blocks": pool.num_blocks, "num_free_blocks": pool.num_free_blocks,
                "num_cached_blocks": len(pool.cached), "usage": pool.usage(),
                "num_running": len(self.running), "num_waiting": len(self.waiting),
                "blocks_per_request": {r.request_id: self.kv.num_held_blocks(r.request_id) for r in self.running},
                "num_swapped": self.num_swapped,
                "num_host_blocks": self.host_pool.num_blocks, "num_free_host_blocks": self.host_pool.num_free,
                "consistent": problem is None, "problem": problem} | self._state_slots()

    def _state_slots(self) -> dict:
        """A hybrid model's recurrent-state slots: held by running requests, free, holding prefix snapshots."""
        st = self.kv.states
        if st is None:
            return {}
        return {"state_slots": {"num_slots": st.num_slots, "num_held": len(st.owner), "num_free": st.num_free,
                                "num_snapshots": st.num_snapshots}}

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            **dataclasses.asdict(self.counters),
            **dataclasses.asdict(self.spec_counters),  # a copy: spec_accepted_per_pos goes on changing
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            num_free_blocks=self.kv.pool.num_free_blocks, num_blocks=self.kv.num_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_batched_tokens=self.last_step_tokens,
            token_budget=self.token_budget,
            num_swapped=self.num_swapped,
            **({} if self.kv.states is None else dict(
                num_state_slots=self.kv.states.num_slots, num_state_slots_held=len(self.kv.states.owner),
                num_state_snapshots=self.kv.states.num_snapshots)),
        )
