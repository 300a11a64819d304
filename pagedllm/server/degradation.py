"""Degradation for the server: which engine serves a request (the primary, or a fallback model), a circuit breaker
on the primary engine and a fault-injection switch for tests.

Breaker: closed -> open after ``threshold`` consecutive failures or timeouts inside ``window_s``; open -> half-open
after ``cooldown_s``, letting ``half_open_probes`` requests try the primary; a probe's success closes it, a failure
opens it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request

from pagedllm.config import json_object
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.errors import EngineDeadError, EngineOverloadedError, RequestFailedError
from pagedllm.server.streaming import first_outputs

logger = logging.getLogger("pagedllm.server")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_CODE = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}


class CircuitBreaker:
    def __init__(self, threshold: int = 5, window_s: float = 60.0, cooldown_s: float = 30.0,
                 half_open_probes: int = 1, clock=time.monotonic) -> None:
        if threshold < 1 or cooldown_s < 0 or half_open_probes < 1:
            raise ValueError("circuit breaker: threshold >= 1, cooldown >= 0, probes >= 1")
        self.threshold, self.window_s, self.cooldown_s = threshold, window_s, cooldown_s
        self.half_open_probes = half_open_probes
        self.clock = clock
        self._state = CLOSED
        self._failures: list[float] = []
        self._opened_at = 0.0
        self._probes_in_flight = 0
        self.times_opened = 0

    @property
    def state(self) -> str:
        if self._state == OPEN and self.clock() - self._opened_at >= self.cooldown_s:
            self._state = HALF_OPEN
            self._probes_in_flight = 0
        return self._state

    def allow(self) -> bool:
        """May this request go to the primary? (In half-open, counts it as a probe.)"""
        st = self.state
        if st == CLOSED:
            return True
        if st == HALF_OPEN and self._probes_in_flight < self.half_open_probes:
            self._probes_in_flight += 1
            return True
        return False

    def record_success(self) -> None:
        if self._state == HALF_OPEN:
            self._state = CLOSED
        self._failures.clear()
        self._probes_in_flight = max(self._probes_in_flight - 1, 0)

    def record_failure(self) -> None:
        now = self.clock()
        if self.state == HALF_OPEN:
            self._open(now)
            return
        self._failures = [t for t in self._failures if now - t <= self.window_s] + [now]
        if len(self._failures) >= self.threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self._state = OPEN
        self._opened_at = now
        self._failures.clear()
        self._probes_in_flight = 0
        self.times_opened += 1

    def detail(self) -> dict:
        return {"state": self.state, "consecutive_failures": len(self._failures), "times_opened": self.times_opened}


@dataclass(frozen=True)
class FaultInjection:
    """Test switch: the primary fails (or stalls) on requests whose prompt text contains a marker; with
    ``forward_fail_token`` the model's forward pass itself raises whenever its batch holds that token id."""

    fail_marker: str | None = None
    stall_marker: str | None = None
    forward_fail_token: int | None = None

    @staticmethod
    def parse(spec: str | None) -> "FaultInjection | None":
        if not spec:
            return None
        d = json_object(spec, "--fault-injection", {"fail_marker", "stall_marker", "forward_fail_token"})
        token = d.get("forward_fail_token")
        if token is not None and (not isinstance(token, int) or token < 0):
            raise ValueError("--fault-injection: forward_fail_token must be a token id")
        return FaultInjection(d.get("fail_marker"), d.get("stall_marker"), token)

    def action(self, text: str | None) -> str | None:
        if text is None:
            return None
        if self.fail_marker and self.fail_marker in text:
            return "fail"
        if self.stall_marker and self.stall_marker in text:
            return "stall"
        return None

    async def apply(self, text: str | None) -> None:
        """Before a primary stream's first output: fail, or stall for ever, when the prompt holds a marker."""
        action = self.action(text)
        if action == "fail":
            raise RequestFailedError("injected fault: the primary failed")
        if action == "stall":
            await asyncio.Event().wait()  # never set: the primary stalls


# queue(engine) queues a request's prompts on an engine -> (its streams, the prompts' texts)
QueueFn = Callable[[AsyncLLM], Awaitable[tuple[list[AsyncIterator], list[str | None]]]]


class FallbackRouter:
    """Which engine serves a request: the primary, or the fallback model when the primary's circuit is open, when
    the primary fails before its first token, or when it does not start within the request timeout."""

    def __init__(self, primary: AsyncLLM, primary_name: str, fallback: AsyncLLM | None = None,
                 fallback_name: str | None = None, breaker: CircuitBreaker | None = None,
                 request_timeout_s: float | None = None, faults: FaultInjection | None = None) -> None:
        self.primary, self.primary_name = primary, primary_name
        self.fallback, self.fallback_name = fallback, fallback_name
        self.breaker = breaker
        self.request_timeout_s = request_timeout_s
        self.faults = faults

    async def route(self, model: str, queue: QueueFn, raw: Request, stream: bool) -> tuple[list[AsyncIterator], str]:
        """Queue the request (``queue``) where it is served; returns its streams and the name of the model serving
        them. A stream's first output is awaited before the response starts, so that a request the engine drops
        while queued (overload) gets its HTTP status (503 + Retry-After) rather than an error inside a 200 stream:
        always when streaming, and on the primary whenever it may fail over (fallback, timeout, fault injection)."""
        guarded = self.fallback is not None or self.request_timeout_s is not None or self.faults is not None
        if model != self.fallback_name and (self.breaker is None or self.breaker.allow()):
            gens, texts = await queue(self.primary)
            if not guarded:
                return (await first_outputs(gens, raw) if stream else gens), self.primary_name
            faults = self.faults
            try:
                gens = await first_outputs(gens, raw, self.request_timeout_s,
                                           None if faults is None else (lambda i: faults.apply(texts[i])))
            except (asyncio.TimeoutError, RequestFailedError, EngineDeadError) as e:
                if self.breaker is not None:
                    self.breaker.record_failure()
                if self.fallback is None:
                    if isinstance(e, asyncio.TimeoutError):
                        raise EngineOverloadedError(
                            f"the request did not start within {self.request_timeout_s:g} s", 503) from None
                    raise
                logger.warning("primary failed (%s); serving the request with the fallback model",
                               type(e).__name__ if isinstance(e, asyncio.TimeoutError) else e)
            else:
                if self.breaker is not None:
                    self.breaker.record_success()
                return gens, self.primary_name
        elif self.fallback is None:
            raise EngineOverloadedError("the primary model's circuit breaker is open", 503, retry_after=1.0)
        gens, _ = await queue(self.fallback)
        return (await first_outputs(gens, raw) if stream else gens), self.fallback_name
