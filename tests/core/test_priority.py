"""Priority scheduling, queue bounds and maximum queue delay, driven by the fake worker (no model)."""

import time

import pytest

from pagedllm.errors import EngineOverloadedError
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from test_scheduler import Driver, assert_all_free, make_sched


def req(rid, n_prompt=8, max_tokens=6, priority=0, arrival=None, delay=None):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    r = Request(rid, [100 + i for i in range(n_prompt)], sp, eos_token_id=None, max_tokens=max_tokens,
                arrival_time=arrival, priority=priority, max_queue_delay_ms=delay)
    return r


def sched(num_blocks=64, max_num_seqs=8, policy="priority", **kw):
    return make_sched(num_blocks, 4, 64, max_num_seqs, 256, enable_caching=False, policy=policy, **kw)


def test_high_priority_waits_less_under_saturation():
    s = sched(max_num_seqs=1)
    drv = Driver(s)
    t0 = time.monotonic()
    for i in range(3):
        s.add_request(req(f"low{i}", priority=5, arrival=t0 + i * 1e-3))
    drv.step()  # low0 runs
    s.add_request(req("high", priority=0, arrival=t0 + 1.0))
    order = []
    while s.has_unfinished_requests():
        so, _ = drv.step()
        order += [x.req_id for x in so.scheduled if x.req_id not in order]
    # high preempted low0 (worse priority) and ran before every other low-priority request
    assert order[0] == "high"
    assert order.index("high") < order.index("low1") < order.index("low2")
    assert s.counters.num_preemptions == 1
    for rid in ("low0", "low1", "low2", "high"):
        assert len(drv.tokens[rid]) == 6
    assert_all_free(s)


def test_fcfs_does_not_reorder():
    s = sched(max_num_seqs=1, policy="fcfs")
    drv = Driver(s)
    s.add_request(req("a", priority=9))
    s.add_request(req("b", priority=0))
    so, _ = drv.step()
    assert [x.req_id for x in so.scheduled] == ["a"]


def test_preemption_victim_is_lowest_priority_not_latest():
    # 6 blocks of 4 tokens; three requests grow until blocks run out
    s = sched(num_blocks=6)
    drv = Driver(s)
    t0 = time.monotonic()
    s.add_request(req("p0", n_prompt=3, max_tokens=10, priority=0, arrival=t0))
    s.add_request(req("p2", n_prompt=3, max_tokens=10, priority=2, arrival=t0 + 0.001))
    s.add_request(req("p1", n_prompt=3, max_tokens=10, priority=1, arrival=t0 + 0.002))
    victims = []
    while s.has_unfinished_requests():
        before = {r.request_id for r in s.running}
        drv.step()
        victims += [rid for rid in before if s.requests.get(rid) and s.requests[rid].status == RequestStatus.PREEMPTED]
    assert victims and victims[0] == "p2", victims
    assert all(len(drv.tokens[r]) == 10 for r in ("p0", "p1", "p2"))
    assert_all_free(s)


def test_queue_full_is_refused_with_429():
    s = sched(max_waiting_requests=2)
    s.add_request(req("a"))
    s.add_request(req("b"))
    with pytest.raises(EngineOverloadedError, match="queue is full") as e:
        s.add_request(req("c"))
    assert e.value.status == 429 and e.value.retry_after
    assert "c" not in s.requests


def test_max_queue_delay_drops_waiting_requests():
    s = sched(max_num_seqs=1, max_queue_delay_ms=50)
    drv = Driver(s)
    s.add_request(req("runs", max_tokens=30))
    drv.step()
    s.add_request(req("late", arrival=time.monotonic() - 1.0))  # already waited 1 s
    s.add_request(req("patient", arrival=time.monotonic() - 1.0, delay=60_000))  # its own, longer limit
    so, outs = drv.step()
    dropped = [o for o in outs if o.finish_reason == "overloaded"]
    assert [o.req_id for o in dropped] == ["late"] and "50 ms" in dropped[0].stop_reason
    assert "late" not in s.requests and s.counters.num_rejected == 1
    drv.run()
    assert len(drv.tokens["patient"]) == 6
    assert_all_free(s)
