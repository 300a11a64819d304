"""A hybrid model's recurrent-state slots in the core (no model, no torch): each running request holds one slot,
a new sequence's slot starts empty, prefix hits restore the snapshot a prompt saved at its last block boundary,
snapshots are evicted when live sequences need slots, and preemption restarts the state.

The fake worker keeps each slot's "state" as the tuple of tokens it has absorbed, applies the step's restores
before its resets (as the model runner does), and checks for every scheduled chunk that its slot holds exactly the
request's tokens before the chunk: a slot shared by two live requests, a stale snapshot or a wrong restore fails
loudly."""

from __future__ import annotations

import random

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.state_pool import StatePool
from pagedllm.outputs import ModelRunnerOutput
from test_scheduler import fake_token, make_req

BS = 4


def make_sched(num_blocks=64, budget=8, max_num_seqs=4, state_slots=5, shifted_kv=False) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=True, num_state_slots=state_slots,
                        state_live_slots=max_num_seqs, shifted_kv=shifted_kv)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, enable_chunked_prefill=True)
    return Scheduler(config, CacheConfig(block_size=BS, enable_prefix_caching=True), kv, 256)


class StateWorker:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.state: dict[int, tuple] = {}
        self.restores = 0

    def execute(self, so) -> ModelRunnerOutput:
        for s in so.scheduled:  # restores first: a slot zeroed below may have been a snapshot restored here
            if s.state_restore >= 0:
                self.state[s.state_slot] = self.state[s.state_restore]
                self.restores += 1
        for s in so.scheduled:
            if s.state_restore < 0 and s.num_computed_tokens == 0:
                self.state[s.state_slot] = ()
        assert len({s.state_slot for s in so.scheduled}) == len(so.scheduled)
        out = ModelRunnerOutput()
        for s in so.scheduled:
            req = self.sched.requests[s.req_id]
            before = self.state[s.state_slot]
            assert before == tuple(req.all_token_ids[:s.num_computed_tokens]), s.req_id
            if s.state_save_rows:
                self.state[s.state_save_slot] = before + tuple(s.token_ids[:s.state_save_rows])
            self.state[s.state_slot] = before + tuple(s.token_ids)
            if s.sample:
                out.sampled_token_ids[s.req_id] = [fake_token(s.req_id, s.num_output_tokens)]
        return out


def run(sched: Scheduler, worker: StateWorker, max_steps: int = 5000) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        so = sched.schedule()
        for o in sched.update_from_output(so, worker.execute(so)):
            outs.setdefault(o.req_id, []).extend(o.new_token_ids)
        sched.kv.check_integrity()
    raise AssertionError("did not finish")


def test_slots_follow_requests_and_prefix_hits_restore_snapshots():
    sched = make_sched(max_num_seqs=4, state_slots=6)
    worker = StateWorker(sched)
    rng = random.Random(0)
    base = [rng.randrange(50, 900) for _ in range(22)]
    # round 1: a prompt alone saves a snapshot at block 5 (its last boundary: 20 tokens)
    sched.add_request(make_req("a", base, max_tokens=3))
    run(sched, worker)
    assert sched.kv.states.num_snapshots == 1 and sched.kv.prefix_cache_hits == 0
    # round 2: prompts extending it restore the snapshot (20 tokens each); more requests than state slots
    for i in range(6):
        sched.add_request(make_req(f"b{i}", base + [rng.randrange(50, 900) for _ in range(3 + i)], max_tokens=4))
    run(sched, worker)
    assert worker.restores >= 1 and sched.kv.prefix_cache_hits >= 20
    st = sched.kv.states
    assert not st.owner and st.num_free == st.num_slots


def test_shifted_kv_hits_stop_a_block_short_and_snapshot_there():
    """An MTP module's K/V at a block's last position read the next block's first token: hits leave the last
    cached block to compute again, and a prompt saves its snapshot one block earlier (16 of 22 tokens, not 20),
    keyed by that block's hash although the request's hashes go further (a snapshot keyed by a later block would
    restore a state that is not the prefix's: the worker's check fails)."""
    sched = make_sched(max_num_seqs=4, state_slots=6, shifted_kv=True)
    worker = StateWorker(sched)
    rng = random.Random(1)
    base = [rng.randrange(50, 900) for _ in range(22)]
    sched.add_request(make_req("a", base, max_tokens=3))
    run(sched, worker)
    assert sched.kv.states.num_snapshots == 1
    for i in range(3):
        sched.add_request(make_req(f"b{i}", base + [rng.randrange(50, 900) for _ in range(3 + i)], max_tokens=4))
    run(sched, worker)
    assert worker.restores >= 1 and sched.kv.prefix_cache_hits == 3 * 16


def test_few_blocks_and_slots_preempt_and_evict_snapshots_without_mixing_states():
    """A busy mix: shared prefixes, chunked prompts, too few blocks (preemption restarts a state) and too few
    free slots to keep every snapshot (least recently freed ones are dropped)."""
    sched = make_sched(num_blocks=12, budget=6, max_num_seqs=3, state_slots=5)
    worker = StateWorker(sched)
    rng = random.Random(1)
    prefixes = [[rng.randrange(50, 900) for _ in range(9)] for _ in range(3)]
    for i in range(16):
        sched.add_request(make_req(f"r{i}", prefixes[i % 3] + [rng.randrange(50, 900) for _ in range(1 + i % 5)],
                                   max_tokens=6 + i % 6))
    outs = run(sched, worker)
    assert len(outs) == 16 and sched.counters.num_preemptions > 0 and worker.restores > 0
    st = sched.kv.states
    assert not st.owner and st.num_free == st.num_slots and st.num_snapshots <= st.num_slots


def test_no_free_slot_means_the_request_waits():
    """Two slots for four running requests: a third request is not admitted until one finishes (never shares a
    slot), and no snapshot takes a slot a request could use."""
    sched = make_sched(max_num_seqs=4, state_slots=2)
    worker = StateWorker(sched)
    for i in range(3):
        sched.add_request(make_req(f"w{i}", [100 + i] * 5, max_tokens=3))
    so = sched.schedule()
    assert {s.req_id for s in so.scheduled} == {"w0", "w1"} and len(sched.waiting) == 1
    sched.update_from_output(so, worker.execute(so))
    run(sched, worker)
    assert sched.kv.states.num_free == 2


def test_new_sequences_take_empty_slots_before_snapshots():
    pool = StatePool(4, live_slots=2)
    a, b = pool.assign("x"), pool.assign("y")
    s1, s2 = pool.reserve(), pool.reserve()
    pool.register(b"k1", s1)
    pool.register(b"k2", s2)
    pool.touch(s1)  # a prefix hit on k1: k2 is now the least recently used snapshot
    pool.release("x")  # free: s1 (k1), s2 (k2) and x's empty slot
    assert pool.assign("z") == a and pool.num_snapshots == 2  # the empty slot first
    pool.release("y")
    assert pool.assign("w") == b
    assert pool.assign("v") == s2 and pool.snapshot(b"k2") is None and pool.snapshot(b"k1") == s1
    pool.check_integrity()


def test_new_sequences_reuse_the_slots_last_released():
    """Sequences one after another (at most two at once) keep to two slots: a slot's pages are committed when a
    sequence first writes them, so taking untouched slots in turn would grow the resident pools to all of them."""
    pool = StatePool(16)
    used = set()
    for i in range(40):
        used.add(pool.assign(f"r{i}"))
        if i:
            pool.release(f"r{i - 1}")
    assert len(used) == 2 and pool.num_free == 15
