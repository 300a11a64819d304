"""Unit tests of the block pool, KV cache manager and scheduler, driven by fake model outputs (no model, no torch).

The fake worker below stands in for the model runner: it keeps a fake KV memory (the token id written at every
slot of every block) and, before it "samples", checks that the request's block table holds exactly the request's
tokens at every position up to the end of the step's chunk. So a wrong block table, a prefix-cache hit on a block
whose content was overwritten, or a recompute that skipped tokens all fail loudly.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zlib
from collections import defaultdict

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.block_pool import BlockPool, hash_block_tokens
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.core.scheduler import Scheduler
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams


# ---------------------------------------------------------------------------- helpers
def make_req(rid, prompt, max_tokens=16, eos=None, **sp_kwargs) -> Request:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, **sp_kwargs)
    return Request(rid, list(prompt), sp, eos_token_id=eos, max_tokens=max_tokens)


def fake_token(req_id: str, num_output_tokens: int) -> int:
    """Deterministic 'model': the next token depends only on the request id and how many tokens it has."""
    return 1000 + zlib.crc32(f"{req_id}/{num_output_tokens}".encode()) % 30000


def make_sched(num_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=256,
               enable_caching=True, enable_chunked_prefill=True, budget_controller=None,
               **scheduler_options) -> Scheduler:
    """A scheduler over a fresh KV cache manager; ``scheduler_options``: more SchedulerConfig fields."""
    kv = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching)
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                             enable_chunked_prefill=enable_chunked_prefill, **scheduler_options)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_caching)
    return Scheduler(config, cache, kv, max_model_len, budget_controller=budget_controller)


def fake_output(so, token_fn=fake_token) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        sampled_token_ids={s.req_id: [token_fn(s.req_id, s.num_output_tokens)] for s in so.scheduled if s.sample}
    )


class FakeWorker:
    def __init__(self, sched: Scheduler, token_fn=fake_token) -> None:
        self.bs = sched.kv.block_size
        self.mem = [[None] * self.bs for _ in range(sched.kv.num_blocks)]
        self.reqs: dict[str, list[int]] = {}  # the worker's copy of each request's tokens
        self.num_prompt: dict[str, int] = {}
        self.token_fn = token_fn

    def execute(self, so) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            assert rid in self.reqs, f"finished id {rid} was never sent to the worker (or sent twice)"
            del self.reqs[rid]
        for nr in so.new_requests:
            assert nr.req_id not in self.reqs, f"{nr.req_id} sent as new twice"
            self.reqs[nr.req_id] = list(nr.prompt_token_ids)
            self.num_prompt[nr.req_id] = len(nr.prompt_token_ids)
        ids = [s.req_id for s in so.scheduled]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        bs = self.bs
        # Every request writes its chunk before any reads (the model writes KV layer by layer before attention).
        for s in so.scheduled:
            toks = self.reqs[s.req_id]
            start, end = s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids)
            assert len(s.token_ids) > 0
            assert end <= len(toks)
            assert s.token_ids == toks[start:end], f"{s.req_id}: scheduled tokens are not the request's tokens"
            assert s.sample == (end == len(toks))
            assert s.num_output_tokens == len(toks) - self.num_prompt[s.req_id]
            (table,) = s.block_ids  # one KV group: no sliding-window layers
            assert len(table) >= cdiv(end, bs), f"{s.req_id}: block table too short"
            assert len(set(table)) == len(table), f"{s.req_id}: a block twice in one block table"
            for j, t in enumerate(s.token_ids):
                p = start + j
                self.mem[table[p // bs]][p % bs] = t
        sampled = {}
        for s in so.scheduled:
            end = s.num_computed_tokens + len(s.token_ids)
            seen = [self.mem[s.block_ids[0][p // bs]][p % bs] for p in range(end)]
            assert seen == self.reqs[s.req_id][:end], f"{s.req_id}: KV memory does not hold the request's tokens"
            if s.sample:
                tok = self.token_fn(s.req_id, s.num_output_tokens)
                sampled[s.req_id] = [tok]
                self.reqs[s.req_id].append(tok)
        return ModelRunnerOutput(sampled_token_ids=sampled)


def check_step(sched: Scheduler, so) -> None:
    """Invariants that must hold right after every schedule()."""
    kv = sched.kv
    n = sum(len(s.token_ids) for s in so.scheduled)
    assert n <= sched.config.max_num_batched_tokens
    assert n == so.num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs
    assert {r.request_id for r in sched.running} == set(kv.req_to_blocks), "blocks held by non-running requests"
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        assert len(kv.req_to_blocks[r.request_id][0]) == cdiv(r.num_computed_tokens, kv.block_size)
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0
    kv.check_integrity()


class Driver:
    """schedule -> fake worker -> update_from_output, with checks after each step."""

    def __init__(self, sched: Scheduler, token_fn=fake_token) -> None:
        self.sched = sched
        self.worker = FakeWorker(sched, token_fn)
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finished: dict[str, object] = {}  # req_id -> final EngineCoreOutput
        self.steps = 0

    def step(self):
        so = self.sched.schedule()
        check_step(self.sched, so)
        outs = self.sched.update_from_output(so, self.worker.execute(so))
        for o in outs:
            assert o.req_id not in self.finished, f"output for {o.req_id} after it finished"
            self.tokens[o.req_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finished[o.req_id] = o
        self.sched.kv.check_integrity()
        self.steps += 1
        return so, outs

    def run(self, max_steps=5000, before_step=None):
        empty_in_a_row = 0
        while self.sched.has_unfinished_requests():
            if before_step is not None:
                before_step(self)
            so, _ = self.step()
            empty_in_a_row = empty_in_a_row + 1 if so.is_empty else 0
            assert empty_in_a_row <= 1, "scheduler makes no progress"
            assert self.steps < max_steps
        # One more step delivers the last finished ids to the worker.
        so = self.sched.schedule()
        assert so.is_empty
        self.worker.execute(so)
        assert self.worker.reqs == {}, f"worker never told these finished: {list(self.worker.reqs)}"


def assert_all_free(sched: Scheduler) -> None:
    kv, pool = sched.kv, sched.kv.pool
    kv.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert kv.req_to_blocks == {} and kv.num_cached_blocks == {} and kv.req_to_hashes == {}
    assert sched.requests == {} and not sched.running and not sched.waiting
    # free + cached accounting: every cached block is a free block (ref 0, in the free queue) holding its hash,
    # and no other block claims a hash.
    free_ids = {b.block_id for b in pool.free_queue}
    assert len(free_ids) == pool.num_blocks
    for h, b in pool.cached.items():
        assert b.block_hash == h and b.ref_cnt == 0 and b.block_id in free_ids and b.token_ids is not None
    assert sum(1 for b in pool.blocks if b.block_hash is not None) == len(pool.cached)
    assert pool.usage() == 0.0


# ---------------------------------------------------------------------------- 1. no block leak
@pytest.mark.parametrize("enable_caching", [True, False])
def test_no_block_leak_many_requests(enable_caching):
    num_blocks, bs = 40, 4
    sched = make_sched(num_blocks, bs, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64,
                       enable_caching=enable_caching)
    rng = random.Random(1234)
    eos = 3

    def token_fn(rid, n):  # small vocabulary so that eos turns up now and then
        return 2 + zlib.crc32(f"{rid}/{n}".encode()) % 40

    prefixes = [[rng.randrange(100, 200) for _ in range(12)] for _ in range(3)]
    reqs = []
    for i in range(40):
        if i % 3 == 0:  # shared prefix (full blocks, and a partial one)
            prompt = prefixes[i % 2][: rng.choice([4, 8, 10, 12])] + [rng.randrange(100, 200)
                                                                      for _ in range(rng.randrange(0, 10))]
        else:
            prompt = [rng.randrange(100, 200) for _ in range(rng.randrange(1, 40))]
        prompt = prompt or [7]
        reqs.append(make_req(f"r{i}", prompt, max_tokens=rng.randrange(1, 30), eos=eos if i % 2 else None))
    aborted = set()
    pending = list(reqs)
    drv = Driver(sched, token_fn)

    def before_step(d):
        for _ in range(rng.randrange(0, 4)):  # arrivals spread over time
            if pending:
                sched.add_request(pending.pop(0))
        if d.steps % 7 == 3 and sched.requests:  # an abort now and then, running or waiting
            rid = rng.choice(sorted(sched.requests))
            assert [r.request_id for r in sched.finish_requests(rid)] == [rid]
            aborted.add(rid)
            sched.kv.check_integrity()

    for _ in range(3):
        sched.add_request(pending.pop(0))
    while pending or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests():
            sched.add_request(pending.pop(0))
        drv.run(before_step=before_step)
    assert aborted and len(drv.finished) + len(aborted) == len(reqs)
    assert_all_free(sched)

    # Each finished request's tokens are the fake model's, and it stopped for the reason it says.
    for r in reqs:
        if r.request_id in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
            continue
        toks = drv.tokens[r.request_id]
        assert toks == r.output_token_ids == [token_fn(r.request_id, i) for i in range(len(toks))]
        fin = drv.finished[r.request_id]
        if r.eos_token_id is not None and eos in toks:
            assert toks.index(eos) == len(toks) - 1 and fin.finish_reason == "stop"
        else:
            assert fin.finish_reason == "length"
            assert len(toks) == r.max_tokens or r.num_tokens == 64


# ---------------------------------------------------------------------------- 2. LRU eviction order
def _alloc_full(kv: KVCacheManager, req: Request) -> list[int]:
    assert kv.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    return kv.get_block_ids(req.request_id)[0]


def _hits(kv: KVCacheManager, rid: str, prompt: list[int]) -> int:
    (blocks,), n = kv.get_computed_blocks(make_req(rid, prompt))
    assert n == len(blocks) * kv.block_size
    return len(blocks)


def test_lru_eviction_order():
    bs = 4
    kv = KVCacheManager(num_blocks=8, block_size=bs)
    pa, pb = list(range(100, 116)), list(range(200, 216))  # 4 full blocks each: the whole pool
    a, b = make_req("A", pa), make_req("B", pb)
    a_ids, b_ids = _alloc_full(kv, a), _alloc_full(kv, b)
    assert kv.pool.num_free_blocks == 0 and len(kv.pool.cached) == 8
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    # free() releases tail blocks first; A was freed before B.
    assert [blk.block_id for blk in kv.pool.free_queue] == a_ids[::-1] + b_ids[::-1]
    assert _hits(kv, "qa", pa + [1]) == 4 and _hits(kv, "qb", pb + [1]) == 4

    evicted = []
    expected_hits = [(3, 4), (2, 4), (1, 4), (0, 4), (0, 3), (0, 2), (0, 1), (0, 0)]
    for k in range(8):
        (blk,) = kv.pool.get_new_blocks(1)
        evicted.append(blk.block_id)
        assert blk.ref_cnt == 1 and blk.block_hash is None and blk.token_ids is None
        assert kv.pool.num_evictions == k + 1
        assert len(kv.pool.cached) == 7 - k
        assert (_hits(kv, "qa", pa + [1]), _hits(kv, "qb", pb + [1])) == expected_hits[k]
    # A (least recently freed) goes first, and within each request the tail goes before the head.
    assert evicted == a_ids[::-1] + b_ids[::-1]


def test_lru_cache_hit_refreshes_recency():
    """A cached free block that is hit and freed again becomes most recently freed: B is now evicted first."""
    bs = 4
    kv = KVCacheManager(num_blocks=9, block_size=bs)
    pa, pb = list(range(100, 116)), list(range(200, 216))
    a, b = make_req("A", pa), make_req("B", pb)
    a_ids, b_ids = _alloc_full(kv, a), _alloc_full(kv, b)
    kv.free(a)
    kv.free(b)
    # The one never-used block is at the head of the queue: a one-token request takes it (and keeps it).
    (first,) = _alloc_full(kv, make_req("X", [7]))
    assert first not in a_ids + b_ids
    a2 = make_req("A2", pa + [1, 2])
    hits, n = kv.get_computed_blocks(a2)
    assert [h.block_id for h in hits[0]] == a_ids and n == 16
    new = kv.allocate_slots(a2, 2, hits)
    assert [x.block_id for x in new] == [b_ids[-1]]  # B's tail was at the head of the free queue: evicted
    kv.check_integrity()
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in a_ids)
    a2.num_computed_tokens = 18
    kv.free(a2)
    order = [blk.block_id for blk in kv.pool.free_queue]
    # A2's partial block (uncached) goes to the head, reused first; A's cached blocks are now most recent
    assert order == [new[0].block_id] + b_ids[-2::-1] + a_ids[::-1]
    assert _hits(kv, "qb", pb + [1]) == 3  # B lost its tail block only


@pytest.mark.parametrize("caching", [False, True])
def test_uncached_blocks_are_reused_first(caching):
    """A freed block without cached content is handed out again before any other free block (its memory is
    already committed and warm), so requests that come and go keep using the same few blocks."""
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=caching)
    used = set()
    for i in range(20):  # one request at a time, each of 2 blocks (the second partial: never cached)
        r = make_req(f"R{i}", [1000 * i + j for j in range(6)])
        used |= set(_alloc_full(kv, r))
        kv.free(r)
        kv.check_integrity()
    # without caching the same 2 blocks serve every request; with caching each full block stays cached (LRU)
    assert len(used) == (2 if not caching else 21)


# ---------------------------------------------------------------------------- 3. reference counts, prefix sharing
def test_shared_prefix_ref_counts():
    bs = 4
    sched = make_sched(num_blocks=32, block_size=bs, max_num_batched_tokens=64)
    kv, pool = sched.kv, sched.kv.pool
    drv = Driver(sched)
    prefix = list(range(500, 512))  # 3 full blocks
    r1 = make_req("R1", prefix + [1, 2], max_tokens=6)
    sched.add_request(r1)
    drv.step()
    assert r1.num_cached_tokens == 0
    r1_blocks = list(kv.req_to_blocks["R1"][0])
    r2 = make_req("R2", prefix + [3, 4], max_tokens=6)
    hits, n = kv.get_computed_blocks(r2)
    assert hits == [r1_blocks[:3]] and n == 12  # the very block objects of R1
    sched.add_request(r2)
    so, _ = drv.step()
    (s2,) = [s for s in so.scheduled if s.req_id == "R2"]
    assert s2.num_computed_tokens == 12 and s2.token_ids == [3, 4] and s2.sample
    assert r2.num_cached_tokens == 12
    assert kv.req_to_blocks["R2"][0][:3] == r1_blocks[:3]
    assert kv.req_to_blocks["R2"][0][3] is not r1_blocks[3]
    assert [b.ref_cnt for b in r1_blocks[:3]] == [2, 2, 2]
    assert r1_blocks[3].ref_cnt == 1 and kv.req_to_blocks["R2"][0][3].ref_cnt == 1
    assert kv.prefix_cache_hits == 12 and kv.prefix_cache_queries == 14 + 14

    free_before = pool.num_free_blocks
    sched.finish_requests("R1")
    kv.check_integrity()
    assert [b.ref_cnt for b in r1_blocks[:3]] == [1, 1, 1]
    assert pool.num_free_blocks == free_before + len(r1_blocks) - 3  # only R1's own blocks came back
    assert all(b not in list(pool.free_queue) for b in r1_blocks[:3])
    drv.run()
    assert drv.tokens["R2"] == [fake_token("R2", i) for i in range(6)]
    assert_all_free(sched)


@pytest.mark.parametrize("prompt_len", [12, 13, 4, 1])
def test_prefix_hit_leaves_a_token_to_compute(prompt_len):
    bs = 4
    sched = make_sched(num_blocks=32, block_size=bs)
    kv = sched.kv
    drv = Driver(sched)
    prompt = list(range(700, 700 + prompt_len))
    sched.add_request(make_req("first", prompt, max_tokens=1))
    drv.run()
    # The whole prompt is cached now (as full blocks); a second identical prompt must still compute >= 1 token.
    again = make_req("again", prompt, max_tokens=2)
    hits, n = kv.get_computed_blocks(again)
    assert n % bs == 0 and n < prompt_len
    assert n == (prompt_len - 1) // bs * bs  # every full block except when it would cover the last token
    sched.add_request(again)
    so, _ = drv.step()
    (s,) = so.scheduled
    assert s.num_computed_tokens == n and len(s.token_ids) == prompt_len - n and s.sample
    assert kv.req_to_blocks["again"][0][: len(hits[0])] == hits[0]
    drv.run()
    assert drv.tokens["again"] == [fake_token("again", i) for i in range(2)]
    assert_all_free(sched)


def test_same_step_siblings_share_prompt_blocks():
    """n>1-like children: identical prompts admitted in one schedule() share the full prompt blocks."""
    bs = 4
    sched = make_sched(num_blocks=32, block_size=bs, max_num_batched_tokens=64)
    kv = sched.kv
    drv = Driver(sched)
    prompt = list(range(300, 310))  # 2 full blocks + 2 tokens
    for i in range(3):
        sched.add_request(make_req(f"c{i}", prompt, max_tokens=4))
    so, _ = drv.step()
    assert [s.req_id for s in so.scheduled] == ["c0", "c1", "c2"]
    assert [(s.num_computed_tokens, len(s.token_ids)) for s in so.scheduled] == [(0, 10), (8, 2), (8, 2)]
    assert so.num_batched_tokens == 14
    tables = [kv.req_to_blocks[f"c{i}"][0] for i in range(3)]
    ids = [[b.block_id for b in t] for t in tables]
    assert ids[0][:2] == ids[1][:2] == ids[2][:2]
    assert len({t[2].block_id for t in tables}) == 3  # the partial last block is private
    assert [b.ref_cnt for b in tables[0]] == [3, 3, 1]
    assert [r.num_cached_tokens for r in (sched.requests[f"c{i}"] for i in range(3))] == [0, 8, 8]
    assert kv.pool.num_free_blocks == 32 - 5
    drv.run()
    for i in range(3):
        assert drv.tokens[f"c{i}"] == [fake_token(f"c{i}", j) for j in range(4)]
    assert_all_free(sched)


def test_hash_collision_is_not_a_hit():
    bs = 4
    pool = BlockPool(8, enable_caching=True)
    toks = (1, 2, 3, 4)
    h = hash_block_tokens(None, toks)
    blk = pool.blocks[5]
    pool.cache_block(blk, h, (9, 9, 9, 9))  # a different block content under the same hash key
    assert pool.get_cached_block(h, toks) is None
    assert pool.get_cached_block(h, (9, 9, 9, 9)) is blk  # control: the entry itself is found

    kv = KVCacheManager(num_blocks=8, block_size=bs)
    kv.pool.cache_block(kv.pool.blocks[5], h, (9, 9, 9, 9))
    req = make_req("x", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(req) == ([[]], 0)
    # and with the right content the same lookup hits
    kv2 = KVCacheManager(num_blocks=8, block_size=bs)
    kv2.pool.cache_block(kv2.pool.blocks[5], h, toks)
    hits, n = kv2.get_computed_blocks(make_req("y", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert hits == [[kv2.pool.blocks[5]]] and n == 4


def test_no_caching_means_no_hits():
    sched = make_sched(num_blocks=32, block_size=4, enable_caching=False)
    drv = Driver(sched)
    prompt = list(range(10, 30))
    sched.add_request(make_req("a", prompt, max_tokens=3))
    drv.run()
    assert sched.kv.pool.cached == {}
    again = make_req("b", prompt, max_tokens=3)
    assert sched.kv.get_computed_blocks(again) == ([[]], 0)
    sched.add_request(again)
    so, _ = drv.step()
    assert so.scheduled[0].num_computed_tokens == 0 and len(so.scheduled[0].token_ids) == 20
    drv.run()
    assert_all_free(sched)


# ---------------------------------------------------------------------------- 4. token budget, chunked prefill
def test_token_budget_and_chunked_prefill():
    sched = make_sched(num_blocks=100, block_size=4, max_num_batched_tokens=32, max_num_seqs=4)
    drv = Driver(sched)
    a = make_req("A", range(1000, 1100), max_tokens=3)  # 100 tokens: 32 + 32 + 32 + 4
    sched.add_request(a)
    chunks = []
    for _ in range(3):
        so, outs = drv.step()
        (s,) = so.scheduled
        chunks.append((s.num_computed_tokens, len(s.token_ids), s.sample))
        assert outs == [] and a.num_output_tokens == 0
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False)]
    b = make_req("B", range(2000, 2040), max_tokens=3)
    sched.add_request(b)
    so, outs = drv.step()  # A's last chunk, and B's first chunk in the budget left
    got = {s.req_id: (s.num_computed_tokens, len(s.token_ids), s.sample) for s in so.scheduled}
    assert got == {"A": (96, 4, True), "B": (0, 28, False)}
    assert [o.req_id for o in outs] == ["A"]
    c = make_req("C", range(3000, 3050), max_tokens=3)
    sched.add_request(c)
    so, outs = drv.step()  # A decodes, B finishes its prompt, C starts
    got = {s.req_id: (s.num_computed_tokens, len(s.token_ids), s.sample) for s in so.scheduled}
    assert got == {"A": (100, 1, True), "B": (28, 12, True), "C": (0, 19, False)}
    assert [s.req_id for s in so.scheduled] == ["A", "B", "C"]  # running first, then waiting
    assert so.num_batched_tokens == 32
    drv.run()
    for r in (a, b, c):
        assert drv.tokens[r.request_id] == [fake_token(r.request_id, i) for i in range(3)]
    assert_all_free(sched)


def test_max_num_seqs_and_budget_every_step():
    sched = make_sched(num_blocks=200, block_size=4, max_num_batched_tokens=24, max_num_seqs=4)
    drv = Driver(sched)
    for i in range(6):
        sched.add_request(make_req(f"s{i}", [60 + i, 61, 62], max_tokens=4))
    so, _ = drv.step()
    assert [s.req_id for s in so.scheduled] == ["s0", "s1", "s2", "s3"]  # budget left, but no sequence slot
    assert len(sched.running) == 4 and len(sched.waiting) == 2
    rng = random.Random(7)
    for i in range(10):
        sched.add_request(make_req(f"q{i}", [rng.randrange(50, 90) for _ in range(rng.randrange(1, 60))],
                                   max_tokens=rng.randrange(1, 12)))
    while sched.has_unfinished_requests():
        so, _ = drv.step()  # check_step asserts the token budget and max_num_seqs every step
        assert len(so.scheduled) <= 4
    drv.run()
    assert len(drv.finished) == 16
    assert_all_free(sched)


def test_chunked_prefill_disabled_waits_for_room():
    sched = make_sched(num_blocks=64, block_size=4, max_num_batched_tokens=32, enable_chunked_prefill=False)
    drv = Driver(sched)
    sched.add_request(make_req("A", range(100, 120), max_tokens=3))
    sched.add_request(make_req("B", range(200, 220), max_tokens=3))
    so, _ = drv.step()
    assert [(s.req_id, len(s.token_ids)) for s in so.scheduled] == [("A", 20)]
    so, _ = drv.step()
    assert [(s.req_id, len(s.token_ids), s.sample) for s in so.scheduled] == [("A", 1, True), ("B", 20, True)]
    drv.run()
    assert_all_free(sched)


# ---------------------------------------------------------------------------- 5. preemption
@pytest.mark.parametrize("enable_caching", [True, False])
def test_preemption_victim_and_recompute(enable_caching):
    bs = 4
    sched = make_sched(num_blocks=8, block_size=bs, max_num_batched_tokens=64, max_num_seqs=8,
                       enable_caching=enable_caching)
    drv = Driver(sched)
    prompts = {rid: [100 * (k + 1) + j for j in range(7)] for k, rid in enumerate("ABCD")}
    reqs = {rid: make_req(rid, p, max_tokens=12) for rid, p in prompts.items()}
    for r in reqs.values():
        sched.add_request(r)
    so, _ = drv.step()
    assert len(so.scheduled) == 4 and sched.kv.pool.num_free_blocks == 0  # 2 blocks each: the whole pool

    victims = []
    first = True
    while sched.has_unfinished_requests():
        order = [r.request_id for r in sched.running]
        total_before = sched.counters.num_preemptions
        so = sched.schedule()
        check_step(sched, so)
        k = so.num_preemptions
        assert sched.counters.num_preemptions == total_before + k
        if k:
            preempted = [rid for rid in order if reqs[rid].status == RequestStatus.PREEMPTED]
            # the latest-arrived running requests, and they go back to the front of the queue in order
            assert preempted == order[len(order) - k:]
            assert [r.request_id for r in list(sched.waiting)[:k]] == preempted
            for rid in preempted:
                r = reqs[rid]
                assert r.num_computed_tokens == 0 and rid not in sched.kv.req_to_blocks
                assert rid not in {s.req_id for s in so.scheduled}
            assert {s.req_id for s in so.scheduled} <= set(order)  # nobody is admitted in a preempting step
            if first:
                assert preempted[-1] == "D"  # D arrived last
                first = False
            victims += preempted
        outs = sched.update_from_output(so, drv.worker.execute(so))
        for o in outs:
            drv.tokens[o.req_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                drv.finished[o.req_id] = o
        sched.kv.check_integrity()
        drv.steps += 1
        assert drv.steps < 1000
    drv.run()  # flush finished ids
    assert victims and sched.counters.num_preemptions == len(victims)
    assert sum(r.num_preemptions for r in reqs.values()) == len(victims)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs.values())
    assert_all_free(sched)

    # Same requests alone, with a large pool: same tokens.
    for rid, p in prompts.items():
        solo = make_sched(num_blocks=64, block_size=bs, max_num_batched_tokens=64)
        sdrv = Driver(solo)
        solo.add_request(make_req(rid, p, max_tokens=12))
        sdrv.run()
        assert solo.counters.num_preemptions == 0
        assert drv.tokens[rid] == sdrv.tokens[rid] == reqs[rid].output_token_ids
        assert len(drv.tokens[rid]) == 12


def test_request_that_cannot_grow_preempts_itself_when_last():
    """The last running request that cannot grow is its own victim, and comes back when room frees up."""
    bs = 4
    sched = make_sched(num_blocks=5, block_size=bs, max_num_batched_tokens=64)
    drv = Driver(sched)
    sched.add_request(make_req("A", range(10, 17), max_tokens=6))  # 2 blocks, 3 from its 2nd decode on
    sched.add_request(make_req("B", range(20, 27), max_tokens=6))
    drv.step()
    drv.step()
    so, _ = drv.step()  # A takes the last free block; B has none and is the tail of running
    assert so.num_preemptions == 1 and [s.req_id for s in so.scheduled] == ["A"]
    assert [r.request_id for r in sched.waiting] == ["B"] and [r.request_id for r in sched.running] == ["A"]
    drv.run()
    assert sched.counters.num_preemptions == 1
    assert drv.tokens["A"] == [fake_token("A", i) for i in range(6)]
    assert drv.tokens["B"] == [fake_token("B", i) for i in range(6)]
    assert_all_free(sched)


# ---------------------------------------------------------------------------- 6. stop conditions
def _run_one(req, seq, max_model_len=256):
    sched = make_sched(max_model_len=max_model_len)
    drv = Driver(sched, token_fn=lambda rid, n: seq[n])
    sched.add_request(req)
    drv.run()
    assert_all_free(sched)
    return drv.tokens[req.request_id], drv.finished[req.request_id]


def test_stop_eos():
    req = make_req("e", [1, 2, 3], max_tokens=10, eos=7)
    toks, fin = _run_one(req, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    assert toks == [5, 6, 7]
    assert req.status == RequestStatus.FINISHED_STOPPED and fin.finish_reason == "stop" and fin.stop_reason is None


def test_stop_eos_ignored():
    req = make_req("e", [1, 2, 3], max_tokens=5, eos=7, ignore_eos=True)
    toks, fin = _run_one(req, [7, 7, 7, 7, 7, 7, 7])
    assert toks == [7] * 5
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and fin.finish_reason == "length"


def test_stop_token_ids():
    req = make_req("s", [1, 2, 3], max_tokens=10, eos=7, stop_token_ids=[6, 42])
    toks, fin = _run_one(req, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    assert toks == [5, 6]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert fin.finish_reason == "stop" and fin.stop_reason == 6 and req.stop_reason == 6


@pytest.mark.parametrize("seq,min_tokens,expected_len", [
    ([7, 7, 1, 7, 2, 2, 2, 2], 3, 4),  # eos at outputs 1 and 2 ignored, stops at the 4th
    ([7, 1, 7, 2, 2, 2, 2, 2], 3, 3),  # eos as the min_tokens-th token stops
    ([7, 1, 2, 3, 4, 5, 6, 8], 0, 1),
])
def test_min_tokens_delays_eos(seq, min_tokens, expected_len):
    req = make_req("m", [1, 2, 3], max_tokens=8, eos=7, min_tokens=min_tokens)
    toks, fin = _run_one(req, seq)
    assert toks == seq[:expected_len] and fin.finish_reason == "stop"


def test_min_tokens_delays_stop_token_ids():
    req = make_req("m", [1, 2, 3], max_tokens=8, min_tokens=2, stop_token_ids=[9])
    toks, fin = _run_one(req, [9, 9, 9, 9, 9, 9, 9, 9])
    assert toks == [9, 9] and fin.stop_reason == 9


def test_max_tokens_length_capped():
    req = make_req("l", [1, 2, 3], max_tokens=3, eos=7)
    toks, fin = _run_one(req, [5, 6, 8, 9, 10])
    assert toks == [5, 6, 8]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and fin.finish_reason == "length"


def test_eos_on_last_allowed_token_is_stop():
    req = make_req("l", [1, 2, 3], max_tokens=3, eos=7)
    toks, fin = _run_one(req, [5, 6, 7, 9, 10])
    assert toks == [5, 6, 7] and fin.finish_reason == "stop"


def test_max_model_len_caps():
    req = make_req("c", list(range(1, 7)), max_tokens=100)  # 6 prompt tokens, model length 10
    toks, fin = _run_one(req, list(range(50, 150)), max_model_len=10)
    assert toks == [50, 51, 52, 53] and req.num_tokens == 10
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and fin.finish_reason == "length"


# ---------------------------------------------------------------------------- 7. abort
def test_abort_running_frees_blocks_and_reports_once():
    sched = make_sched(num_blocks=32, block_size=4)
    pool = sched.kv.pool
    drv = Driver(sched)
    sched.add_request(make_req("A", range(100, 110), max_tokens=20))
    sched.add_request(make_req("B", range(200, 210), max_tokens=20))
    drv.step()
    drv.step()
    held_a = len(sched.kv.req_to_blocks["A"][0])
    free_before = pool.num_free_blocks
    done = sched.finish_requests(["A"])
    assert [r.request_id for r in done] == ["A"] and done[0].status == RequestStatus.FINISHED_ABORTED
    assert pool.num_free_blocks == free_before + held_a  # at once, before the next step
    assert "A" not in sched.kv.req_to_blocks and "A" not in sched.requests
    assert [r.request_id for r in sched.running] == ["B"]
    sched.kv.check_integrity()
    assert sched.finish_requests("A") == [] and sched.finish_requests("nope") == []
    so, _ = drv.step()
    assert so.finished_req_ids == ["A"] and [s.req_id for s in so.scheduled] == ["B"]
    so, _ = drv.step()
    assert so.finished_req_ids == []
    sched.finish_requests("B")
    drv.run()
    assert_all_free(sched)


def test_abort_waiting_never_sent_is_not_reported():
    sched = make_sched(num_blocks=32, block_size=4, max_num_seqs=1)
    drv = Driver(sched)
    sched.add_request(make_req("A", range(100, 110), max_tokens=5))
    sched.add_request(make_req("W", range(200, 210), max_tokens=5))
    so, _ = drv.step()
    assert [s.req_id for s in so.scheduled] == ["A"]  # W waits (max_num_seqs=1)
    sched.kv.get_computed_blocks(sched.requests["W"])  # leave some lookup state behind, as a failed admission
    done = sched.finish_requests("W")
    assert done[0].status == RequestStatus.FINISHED_ABORTED
    assert not sched.waiting and "W" not in sched.kv.req_to_blocks and "W" not in sched.kv.req_to_hashes
    so, _ = drv.step()
    assert so.finished_req_ids == [] and "W" not in [n.req_id for n in so.new_requests]
    drv.run()
    assert "W" not in drv.tokens
    assert_all_free(sched)


def test_abort_preempted_request_is_reported():
    """A preempted request waits again, but the worker knows it: aborting it must tell the worker."""
    bs = 4
    sched = make_sched(num_blocks=4, block_size=bs, max_num_batched_tokens=64)
    drv = Driver(sched)
    sched.add_request(make_req("A", range(10, 17), max_tokens=8))
    sched.add_request(make_req("B", range(20, 27), max_tokens=8))
    for _ in range(10):
        so, _ = drv.step()
        if sched.requests["B"].status == RequestStatus.PREEMPTED:
            break
    b = sched.requests["B"]
    assert b.status == RequestStatus.PREEMPTED and b in sched.waiting
    sched.finish_requests("B")
    assert b.status == RequestStatus.FINISHED_ABORTED and b not in sched.waiting
    so, _ = drv.step()
    assert so.finished_req_ids == ["B"]
    drv.run()
    assert_all_free(sched)


def test_abort_while_step_in_flight():
    sched = make_sched(num_blocks=32, block_size=4)
    sched.add_request(make_req("A", range(100, 110), max_tokens=5))
    so = sched.schedule()
    res = fake_output(so)
    assert res.sampled_token_ids == {"A": [fake_token("A", 0)]}
    sched.finish_requests("A")
    assert sched.kv.pool.num_free_blocks == 32
    assert sched.update_from_output(so, res) == []  # the late result of an aborted request is dropped
    so = sched.schedule()
    assert so.is_empty and so.finished_req_ids == ["A"]
    assert_all_free(sched)


# ---------------------------------------------------------------------------- 8. no torch in pagedllm.core
def test_core_imports_without_torch():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import pagedllm.core.scheduler, pagedllm.core.kv_cache_manager, pagedllm.core.block_pool\n"
        "assert sys.modules['torch'] is None\n"
        "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_kv_events_follow_the_prefix_cache():
    """With events recorded (``--kv-events-config``), each block entering the prefix cache is a ``KVBlockStored``
    (its chained hash, its parent's, its tokens) and each evicted one a ``KVBlockRemoved``, in order; a cache hit
    records nothing; without the flag nothing is recorded."""
    from pagedllm.outputs import KVBlockRemoved, KVBlockStored

    bs = 4
    kv = KVCacheManager(num_blocks=4, block_size=bs, record_events=True)
    pa = list(range(100, 110))  # 2 full blocks and a partial one
    a = make_req("A", pa)
    _alloc_full(kv, a)
    h0 = hash_block_tokens(None, pa[:4])
    h1 = hash_block_tokens(h0, pa[4:8])
    assert kv.pool.take_events() == [KVBlockStored(h0, None, tuple(pa[:4])), KVBlockStored(h1, h0, tuple(pa[4:8]))]
    assert kv.pool.take_events() == []  # taken once
    kv.free(a)
    hit = make_req("A2", pa)
    groups, n = kv.get_computed_blocks(hit)
    assert n == 8 and kv.allocate_slots(hit, hit.num_tokens - n, groups) is not None
    assert kv.pool.take_events() == []  # a hit stores nothing new
    kv.free(hit)
    b = make_req("B", list(range(200, 216)))  # 4 blocks: the whole pool, evicting A's two
    _alloc_full(kv, b)
    events = kv.pool.take_events()
    assert [e for e in events if isinstance(e, KVBlockRemoved)] == [KVBlockRemoved(h1), KVBlockRemoved(h0)]
    assert sum(isinstance(e, KVBlockStored) for e in events) == 4
    quiet = KVCacheManager(num_blocks=4, block_size=bs)
    _alloc_full(quiet, make_req("A", pa))
    assert quiet.pool.events is None and quiet.pool.take_events() == []
