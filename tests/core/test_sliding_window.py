"""Sliding-window layer groups in the paged KV cache (no model, no torch): per-group block tables drawn from one
pool, the blocks a sliding group's window has left freed as a request grows, prefix-cache hits that need only the
window, and preemption (recompute and swap) with windowed groups.

The fake worker keeps a fake KV memory (the token written at every slot of every block) and checks, for every
query of every step, that each group's block table holds the request's tokens at every key that query reads: all
earlier positions in a full group, the last ``window`` in a sliding one. A block freed while still in a window,
or a hit on a block whose content was overwritten, fails loudly."""

from __future__ import annotations

import random

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.core.scheduler import Scheduler
from pagedllm.outputs import ModelRunnerOutput
from test_scheduler import fake_token, make_req

BS = 4
WINDOWS = (0, 8, 8)  # a full group and two sliding groups of 8 tokens (Gemma 3's pattern, made small)


def make_sched(num_blocks=64, budget=8, windows=WINDOWS, preemption_mode="recompute", num_host_blocks=0,
               max_num_seqs=8) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=True, windows=windows)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, enable_chunked_prefill=True)
    cache = CacheConfig(block_size=BS, enable_prefix_caching=True, preemption_mode=preemption_mode)
    return Scheduler(config, cache, kv, 256, num_host_blocks=num_host_blocks)


class WindowWorker:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv = sched.kv
        self.mem = [[None] * BS for _ in range(len(self.kv.pool.blocks))]
        self.host = [[None] * BS for _ in range(max(sched.host_pool.num_blocks, 1))]
        self.reqs: dict[str, list[int]] = {}

    def execute(self, so) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for dev, host in so.swap_out:  # before the forward pass, as the runner does
            self.host[host] = list(self.mem[dev])
        for host, dev in so.swap_in:
            self.mem[dev] = list(self.host[host])
        for nr in so.new_requests:
            self.reqs[nr.req_id] = list(nr.prompt_token_ids)
        null = self.kv.null_block.block_id
        for s in so.scheduled:  # every request writes its chunk before any reads (layer by layer)
            toks = self.reqs[s.req_id]
            assert len(s.block_ids) == len(WINDOWS)
            real = [b for t in s.block_ids for b in t if b != null]
            assert len(real) == len(set(real)), f"{s.req_id}: a block twice in its tables"
            for table in s.block_ids:
                for j, t in enumerate(s.token_ids):
                    p = s.num_computed_tokens + j
                    assert table[p // BS] != null, f"{s.req_id}: no block for new token {p}"
                    self.mem[table[p // BS]][p % BS] = t
        sampled = {}
        for s in so.scheduled:
            toks = self.reqs[s.req_id]
            start, end = s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids)
            for g, (w, table) in enumerate(zip(WINDOWS, s.block_ids)):
                for q in range(start, end):
                    for k in range(max(0, q - w + 1) if w else 0, q + 1):
                        assert self.mem[table[k // BS]][k % BS] == toks[k], (
                            f"{s.req_id}: group {g} lost key {k} that query {q} reads")
            if s.sample:
                tok = fake_token(s.req_id, s.num_output_tokens)
                sampled[s.req_id] = [tok]
                toks.append(tok)
        return ModelRunnerOutput(sampled_token_ids=sampled)


def run(sched: Scheduler, max_steps=3000) -> dict[str, list[int]]:
    """Drive the scheduler to the end with the checks above; every step, each running request's sliding groups
    hold no more blocks than their window and the step's chunk can touch."""
    worker, tokens, steps = WindowWorker(sched), {}, 0
    kv = sched.kv
    budget = sched.config.max_num_batched_tokens
    while sched.has_unfinished_requests():
        so = sched.schedule()
        for r in sched.running:
            tables = kv.req_to_blocks[r.request_id]
            for w, t in zip(WINDOWS, tables):
                held = sum(1 for b in t if b is not kv.null_block)
                if w:
                    assert held <= cdiv(w - 1 + budget, BS) + 1, (r.request_id, held)
                else:
                    assert held == len(t)
        for o in sched.update_from_output(so, worker.execute(so)):
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
        kv.check_integrity()
        steps += 1
        assert steps < max_steps
    worker.execute(sched.schedule())
    # every block back in the pool (the null block is not one of them)
    assert kv.req_to_blocks == {} and kv.pool.num_free_blocks == kv.num_blocks
    return tokens


def test_a_growing_request_frees_what_its_windows_left():
    sched = make_sched(num_blocks=40)
    kv = sched.kv
    req = make_req("long", range(100, 120), max_tokens=60)  # 80 tokens: 20 blocks per group without freeing
    sched.add_request(req)
    worker = WindowWorker(sched)
    peak = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        peak = max(peak, kv.num_held_blocks("long"))
        sched.update_from_output(so, worker.execute(so))
        kv.check_integrity()
        if req.num_computed_tokens > 40 and "long" in kv.req_to_blocks:
            full, *sliding = kv.req_to_blocks["long"]
            assert len(full) == cdiv(req.num_computed_tokens, BS)  # the full group keeps everything
            for t in sliding:  # a sliding group: only what the window reads (8 tokens: 3 blocks at most)
                assert sum(1 for b in t if b is not kv.null_block) <= 3
                assert t[0] is kv.null_block
    assert peak < 20 + 2 * 6  # far below 3 groups x 20 blocks
    assert req.num_tokens == 80 and kv.pool.num_free_blocks == kv.num_blocks


def test_random_workload_with_prefixes_chunks_and_preemption():
    """Shared prefixes, chunked prefill, a pool small enough to preempt (recompute): every key every query reads is
    in place, greedy tokens are the fake model's, and the pool is whole at the end."""
    rng = random.Random(7)
    sched = make_sched(num_blocks=60, budget=12)
    prefixes = [list(range(300 + 40 * i, 300 + 40 * i + 16)) for i in range(3)]
    reqs = []
    for i in range(24):
        prompt = rng.choice(prefixes)[: rng.randint(4, 16)] + [rng.randint(5, 90) for _ in range(rng.randint(1, 20))]
        reqs.append(make_req(f"r{i}", prompt, max_tokens=rng.randint(1, 30)))
        sched.add_request(reqs[-1])
    tokens = run(sched)
    for r in reqs:
        assert tokens[r.request_id] == [fake_token(r.request_id, i) for i in range(r.max_tokens)]
    stats = sched.stats()
    assert stats.num_preemptions > 0, "the pool was large enough: nothing was preempted"
    assert stats.prefix_cache_hits > 0


def test_swap_preemption_with_windows():
    """Swap mode: a preempted request's blocks inside its windows go to host blocks and come back in place."""
    sched = make_sched(num_blocks=36, budget=12, preemption_mode="swap", num_host_blocks=64)
    reqs = [make_req(f"s{i}", range(500 + 30 * i, 520 + 30 * i), max_tokens=24) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    tokens = run(sched)
    for r in reqs:
        assert tokens[r.request_id] == [fake_token(r.request_id, i) for i in range(r.max_tokens)]
    assert sched.stats().num_swap_outs > 0 and sched.stats().num_swap_ins > 0


def test_a_prefix_hit_needs_only_the_window_of_the_sliding_groups():
    kv = KVCacheManager(64, BS, enable_caching=True, windows=WINDOWS)
    prompt = list(range(700, 724))  # 6 full blocks
    a = make_req("a", prompt)
    assert kv.allocate_slots(a, 24) is not None
    a.num_computed_tokens = 24
    kv.free(a)
    again = make_req("b", prompt + [1, 2])
    hits, n = kv.get_computed_blocks(again)
    assert n == 24 and [len(t) for t in hits] == [6, 6, 6]
    # the next token (24) reads keys 17..24 in the sliding groups: blocks 4 and 5; before them the null block
    assert all(t[:4] == [kv.null_block] * 4 for t in hits[1:]) and kv.null_block not in hits[0]
    # the sliding groups' first two blocks evicted: the same hit (only the window is needed) ...
    hashes = kv.req_to_hashes["a"]
    for g in (1, 2):
        for i in range(2):
            kv.pool.uncache(kv.pool.cached[kv._key(g, hashes[i])])
    assert kv.get_computed_blocks(make_req("c", prompt + [1, 2]))[1] == 24
    # ... but a block inside a window gone: the hit shrinks to where every window is whole again (token 20 reads
    # keys 13..20: blocks 3 and 4)
    kv.pool.uncache(kv.pool.cached[kv._key(2, hashes[5])])
    b = make_req("d", prompt + [1, 2])
    hits, n = kv.get_computed_blocks(b)
    assert n == 20 and all(t[:3] == [kv.null_block] * 3 for t in hits[1:])
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is not None
    assert [len(t) for t in kv.req_to_blocks["d"]] == [7, 7, 7]
    kv.check_integrity()
    kv.free(b)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.num_blocks
