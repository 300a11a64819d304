"""Circuit breaker state machine with a fake clock; fault-injection parsing."""

import pytest

from pagedllm.server.degradation import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, FaultInjection


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_breaker_opens_half_opens_and_closes():
    clock = Clock()
    cb = CircuitBreaker(threshold=3, window_s=10, cooldown_s=5, half_open_probes=1, clock=clock)
    assert cb.allow() and cb.state == CLOSED
    cb.record_failure()
    cb.record_failure()
    assert cb.state == CLOSED
    cb.record_failure()
    assert cb.state == OPEN and not cb.allow() and cb.times_opened == 1
    clock.t = 5.1
    assert cb.state == HALF_OPEN
    assert cb.allow() and not cb.allow()  # one probe at a time
    cb.record_failure()  # the probe failed: open again
    assert cb.state == OPEN and cb.times_opened == 2
    clock.t = 10.3
    assert cb.allow()
    cb.record_success()
    assert cb.state == CLOSED and cb.allow()


def test_failures_outside_the_window_do_not_count():
    clock = Clock()
    cb = CircuitBreaker(threshold=3, window_s=10, cooldown_s=5, clock=clock)
    cb.record_failure()
    clock.t = 11
    cb.record_failure()
    cb.record_failure()
    assert cb.state == CLOSED
    cb.record_success()
    cb.record_failure()
    assert cb.state == CLOSED  # a success resets the run of failures


def test_fault_injection_parse():
    f = FaultInjection.parse('{"fail_marker": "FAILME", "stall_marker": "STALLME"}')
    assert f.action("please FAILME now") == "fail" and f.action("STALLME") == "stall" and f.action("ok") is None
    assert FaultInjection.parse(None) is None
    with pytest.raises(ValueError, match="unknown keys"):
        FaultInjection.parse('{"explode": 1}')
