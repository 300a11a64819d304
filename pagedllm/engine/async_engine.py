"""AsyncLLM: the engine's continuous-batching loop in a background thread, with per-request asyncio queues.

Callers (the HTTP server) submit requests from the event loop; the loop thread steps the engine while any request
is unfinished and hands a step's outputs back through one ``loop.call_soon_threadsafe`` per event loop. Every
concurrent request joins the same running batch. A failure while stepping fails the requests of that step (each gets the
error) and the loop keeps serving the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.errors import EngineDeadError, EngineFatalError, EngineOverloadedError, RequestFailedError
from pagedllm.outputs import IterationStats, KVCacheSpec, RequestOutput, SchedulerStats
from pagedllm.request import FinishReason
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def _put_all(items: list) -> None:
    """Runs in the caller's event loop: each (queue, item) of one step, in order."""
    for queue, item in items:
        queue.put_nowait(item)


class RequestStream:
    """Async iterator over one request's cumulative outputs; ``aclose()`` before the end aborts the request."""

    def __init__(self, engine: "AsyncLLM", request_id: str, stream: _Stream) -> None:
        self.engine = engine
        self.request_id = request_id
        self._stream = stream
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._stream.queue.get()
        except BaseException:  # cancelled: the caller went away
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self.engine.abort(self.request_id)


class AsyncLLM:
    def __init__(self, config: EngineConfig, stat_loggers: list | None = None, log_stats_interval: float = 10.0):
        self.stat_loggers = list(stat_loggers or [])
        self.log_stats_interval = log_stats_interval
        self._lock = threading.Lock()  # guards every use of self.engine
        self._wake = threading.Condition(self._lock)
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self._closed = False  # shutdown() has stopped the engine (a second call does nothing more)
        self._dirty = False  # something changed (an abort) that metrics should see even without a step
        self._in_forward = False  # the engine thread is in a forward pass, with the lock released
        self._pending_aborts: list[str] = []  # aborts that arrived during a forward pass, applied after it
        self._dead: BaseException | None = None
        self._interval = _IntervalStats()
        # The engine is built and stepped in one thread: torch ops issued from two threads run two OpenMP
        # thread teams that fight over the cores (docs/history.md#figures-from-code-comments).
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(config,), name="pagedllm-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            raise self._init_error
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.runtime = self.engine.runtime
        self.model_path = self.engine.model_path
        self.default_pooling = self.engine.default_pooling
        self.is_embedding_model, self.sentence = self.engine.is_embedding_model, self.engine.sentence

    def _main(self, config: EngineConfig) -> None:
        try:
            self.engine = LLMEngine(config)
        except BaseException as e:  # noqa: BLE001 - re-raised in the constructor's thread
            self._init_error = e
            self._ready.set()
            return
        self.engine.set_forward_section(self._unlocked_forward)
        self._ready.set()
        self._run()

    @contextlib.contextmanager
    def _unlocked_forward(self):
        """The model's forward pass runs without the lock (the engine thread holds it for scheduling and
        bookkeeping only): a new request is queued, and stats are read, without waiting for the step. Measured
        with `bench overhead` at C=32: the event loop spent ~20% of the run blocked on this lock before."""
        self._in_forward = True
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            self._in_forward = False
            self._wake.notify_all()  # a shutdown waits for the forward pass to end

    # ------------------------------------------------------------------ state
    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None and not self._stop and self._init_error is None

    def stats(self) -> SchedulerStats:
        with self._lock:
            return self.engine.stats()

    def kv_state(self) -> dict:
        with self._lock:
            return self.engine.kv_state()

    def inject_forward_fault(self, token_id: int | None) -> None:
        """Reliability tests: the forward pass raises whenever its batch holds this token id."""
        with self._lock:
            self.engine.inject_forward_fault(token_id)

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.engine.kv_cache_spec()

    def add_tp_failure_callback(self, callback) -> bool:
        return self.engine.add_tp_failure_callback(callback)

    # ------------------------------------------------------------------ requests
    def encode_prompt(self, prompt):
        return self.engine.encode_prompt(prompt)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.engine.encode_text(text, add_special_tokens)

    def encode_for_embedding(self, prompt, prompt_name: str | None = None, truncate: int | None = None):
        return self.engine.encode_for_embedding(prompt, prompt_name, truncate)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None):
        return self.engine.encode_chat(messages, tools, template_kwargs)

    def generate(
        self, prompt_text: str | None, prompt_token_ids: list[int], params: SamplingParams,
        request_id: str | None = None, priority: int = 0, max_queue_delay_ms: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request now (a bad one raises ValueError here) and return an async iterator of its cumulative
        outputs. Closing the iterator before the end (a client that went away) aborts the request.
        Must be called from the event loop that will iterate."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._wake:
            rid = request_id or self.engine.new_request_id()
            self.engine.add_tokenized_request(rid, prompt_text, prompt_token_ids, params, priority,
                                              max_queue_delay_ms=max_queue_delay_ms)
            self._streams[rid] = stream
            self._wake.notify()
        return RequestStream(self, rid, stream)

    def abort(self, request_id: str) -> bool:
        with self._wake:
            self._streams.pop(request_id, None)
            self._dirty = True
            self._wake.notify()
            if self._in_forward:  # the request may be in the step being computed: abort it once the step ends
                self._pending_aborts.append(request_id)
                return self.engine.has_request(request_id)
            return self.engine.abort_request(request_id) is not None

    # ------------------------------------------------------------------ loop
    def _run(self) -> None:
        next_log = time.monotonic() + self.log_stats_interval
        try:
            while True:
                with self._wake:
                    while not self._stop and not self._dirty and not self.engine.has_unfinished_requests():
                        self._wake.wait(timeout=1.0)
                        if time.monotonic() >= next_log:
                            break
                    if self._stop:
                        break
                    self._dirty = False
                    outputs, stats, sched_stats = self._step_locked()
                    for rid in self._pending_aborts:
                        self.engine.abort_request(rid)
                    self._pending_aborts.clear()
                batch: dict[asyncio.AbstractEventLoop, list] = {}
                for out in outputs:
                    exc = next((e for c in out.outputs if (e := _finish_error(c.finish_reason, c.stop_reason))),
                               None)
                    if exc is not None:
                        with self._lock:
                            self.engine.abort_request(out.request_id)  # its other samples, if n > 1
                        self._collect(batch, out.request_id, exc, True)
                    else:
                        self._collect(batch, out.request_id, out, out.finished)
                self._send(batch)
                self._interval.add(stats, sched_stats)
                for sl in self.stat_loggers:
                    try:
                        sl.record(sched_stats, stats)
                    except Exception:  # a metrics bug must not stop serving
                        logger.exception("stat logger failed")
                if time.monotonic() >= next_log:
                    self._interval.log(sched_stats)
                    next_log = time.monotonic() + self.log_stats_interval
        except BaseException as e:  # noqa: BLE001 - the loop must report, not vanish
            logger.exception("engine loop died")
            self._dead = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine loop died: {e}"), True)

    def _step_locked(self) -> tuple[list[RequestOutput], IterationStats, SchedulerStats]:
        if not self.engine.has_unfinished_requests():
            return [], self.engine.drain_aborted_stats(), self.engine.stats()
        scheduled = self.engine.running_request_ids()
        try:
            outputs = self.engine.step()
        except EngineFatalError:  # e.g. a tensor-parallel worker died: the loop dies, every request is told
            raise
        except Exception as e:
            logger.exception("engine step failed; failing the requests of this step")
            running = set(self.engine.running_request_ids()) | set(scheduled)
            for pid in self.engine.request_ids_of(running):
                self.engine.abort_request(pid)
                self._deliver(pid, RequestFailedError(str(e)), True)
            return [], IterationStats(), self.engine.stats()
        return outputs, self.engine.last_iteration_stats, self.engine.stats()

    def _deliver(self, rid: str, item, final: bool) -> None:
        batch: dict[asyncio.AbstractEventLoop, list] = {}
        self._collect(batch, rid, item, final)
        self._send(batch)

    def _collect(self, batch: dict, rid: str, item, final: bool) -> None:
        """Adds (the request's queue, item) to its event loop's list in ``batch`` (the stream is forgotten if final)."""
        stream = self._streams.pop(rid, None) if final else self._streams.get(rid)
        if stream is not None:
            batch.setdefault(stream.loop, []).append((stream.queue, item))

    @staticmethod
    def _send(batch: dict) -> None:
        """A step's outputs reach each event loop in one call: one wake-up of the loop (a write to its self-pipe)
        per step instead of one per request, which on 2 cores took the engine thread ~1.5% of a 32-request run."""
        for loop, items in batch.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's event loop is closed
                pass

    def shutdown(self, timeout: float = 5.0) -> None:
        """Abort what is still running, stop the loop thread."""
        with self._wake:
            self._stop = True  # no new step starts; the one being computed may finish
            deadline = time.monotonic() + timeout
            while self._in_forward and time.monotonic() < deadline:  # let the step being computed end first
                self._wake.wait(timeout=max(deadline - time.monotonic(), 0.01))
            for rid in self.engine.unfinished_request_ids():
                out = self.engine.abort_request(rid)
                if out is not None:
                    self._deliver(rid, out, True)
                else:
                    self._streams.pop(rid, None)
            self._stop = True
            self._wake.notify_all()
        self._thread.join(timeout)
        if not self._thread.is_alive() and not self._closed:  # a step still running would race the shutdown
            self._closed = True
            self.engine.shutdown()


def _finish_error(reason: FinishReason | None, stop_reason) -> Exception | None:
    """The exception a request's caller gets for a finish reason that is an error, else None."""
    if reason == FinishReason.ERROR:
        return RequestFailedError(str(stop_reason))
    if reason == FinishReason.OVERLOADED:
        return EngineOverloadedError(str(stop_reason), 503)
    return None


class _IntervalStats:
    """The periodic stats line (like vLLM's): throughput, queue, KV usage, prefix-cache hit rate."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start = time.monotonic()
        self.prompt_tokens = 0
        self.gen_tokens = 0
        self.queries0: int | None = None
        self.hits0: int | None = None
        self.spec0: tuple[int, int] | None = None

    def add(self, it: IterationStats, s: SchedulerStats) -> None:
        self.prompt_tokens += it.num_prompt_tokens
        self.gen_tokens += it.num_generation_tokens
        if self.queries0 is None:
            self.queries0, self.hits0 = s.prefix_cache_queries, s.prefix_cache_hits
        if self.spec0 is None:
            self.spec0 = (s.spec_num_drafts, s.spec_num_accepted_tokens)

    def log(self, s: SchedulerStats) -> None:
        dt = max(time.monotonic() - self.start, 1e-9)
        q = s.prefix_cache_queries - (self.queries0 or 0)
        h = s.prefix_cache_hits - (self.hits0 or 0)
        if not (self.prompt_tokens or self.gen_tokens or s.num_running or s.num_waiting):
            self.reset()
            return
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, Step token budget: %d",
            self.prompt_tokens / dt, self.gen_tokens / dt, s.num_running, s.num_waiting,
            100 * s.kv_cache_usage, 100 * h / q if q else 0.0, s.token_budget,
        )
        drafts = s.spec_num_drafts - (self.spec0 or (0, 0))[0]
        if drafts:
            accepted = s.spec_num_accepted_tokens - (self.spec0 or (0, 0))[1]
            logger.info("SpecDecoding: drafts %d, mean acceptance length %.2f (tokens per verification step)",
                        drafts, 1 + accepted / drafts)
        self.reset()
        self.queries0, self.hits0 = s.prefix_cache_queries, s.prefix_cache_hits
        self.spec0 = (s.spec_num_drafts, s.spec_num_accepted_tokens)
