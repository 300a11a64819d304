"""The naive baseline: static batching with a max-length KV reservation per sequence (simulated directly, not
through the scheduler).

The deployment reserves ``max_len`` tokens of KV per batch slot, so the batch size is what fits:
``KV memory // (max_len x KV bytes per token)`` (capped by ``max_batch``). When the engine is free it takes up to
that many waiting requests, prefills them padded to the longest prompt, and decodes for the longest output;
every request of the batch is returned when the whole batch finishes (its first token exists after the prefill:
that is its TTFT). Requests arriving meanwhile wait for the next batch.
"""

from __future__ import annotations

import random

from pagedllm.sim.cost import CostModel, Deployment, SeqWork
from pagedllm.sim.metrics import RequestRecord, summarize
from pagedllm.sim.simulator import SimResult
from pagedllm.sim.trace import Workload


def static_batch_size(dep: Deployment, max_len: int, max_batch: int | None = None) -> int:
    """Sequences whose max-length KV reservation fits in the memory left after the weights."""
    plan = dep.memory_plan(block_size=1)
    fit = plan.kv_tokens // max_len
    return min(fit, max_batch) if max_batch else fit


def simulate_static(dep: Deployment, workload: Workload, max_len: int | None = None, max_batch: int | None = None,
                    seed: int = 0, system: str = "naive static batching (max-length KV reservation)") -> SimResult:
    max_len = max_len or dep.model.max_position
    batch = static_batch_size(dep, max_len, max_batch)
    if batch < 1:
        raise ValueError(f"not even one {max_len}-token KV reservation fits next to the weights of {dep.model.name} "
                         f"({dep.scheme.name}) on {dep.tp} x {dep.hardware.name}")
    for r in workload.requests:
        if r.prompt_len + r.output_len > max_len:
            raise ValueError(f"a request of {r.prompt_len} + {r.output_len} tokens exceeds max_len {max_len}")
    cost = CostModel(dep)
    rng = random.Random(seed)
    reqs = workload.requests
    closed = workload.concurrency is not None
    if closed:
        n0 = min(workload.concurrency, len(reqs))
        arrivals = sorted((rng.uniform(0, workload.client_jitter_s), i) for i in range(n0))
        next_idx = n0
    else:
        arrivals = sorted((r.arrival_s, i) for i, r in enumerate(reqs))
        next_idx = len(reqs)
    start_s = arrivals[0][0]
    now = start_s
    pos = 0
    waiting: list[tuple[float, int]] = []
    records: list[RequestRecord] = []
    timeline: list[tuple[float, float]] = []
    step_times: list[float] = []
    usage_area = usage_max = 0.0
    prefill = 0
    while pos < len(arrivals) or waiting:
        while pos < len(arrivals) and arrivals[pos][0] <= now:
            waiting.append(arrivals[pos])
            pos += 1
        if not waiting:
            now = arrivals[pos][0]
            continue
        group, waiting = waiting[:batch], waiting[batch:]
        p_max = max(reqs[i].prompt_len for _, i in group)
        o_max = max(reqs[i].output_len for _, i in group)
        n = len(group)
        reserved = batch * max_len  # tokens of KV reserved, whatever the requests use
        dt = cost.step_time([SeqWork(p_max, 0, 1)] * n)  # padded prompts
        prefill += n * p_max
        step_times.append(dt)
        now += dt
        first = now
        for k in range(1, o_max):
            used = n * (p_max + k) / reserved  # the tokens actually held, as a fraction of the reservation
            timeline.append((now, used))
            usage_area += used * dt
            usage_max = max(usage_max, used)
            dt = cost.step_time([SeqWork(1, p_max + k - 1, 1)] * n)
            step_times.append(dt)
            now += dt
        for t_arr, i in group:
            r = reqs[i]
            records.append(RequestRecord(t_arr, first, now, r.prompt_len, r.output_len))
            if closed and next_idx < len(reqs):
                arrivals.append((now + rng.uniform(0, workload.client_jitter_s), next_idx))
                next_idx += 1
        if closed:
            arrivals[pos:] = sorted(arrivals[pos:])
    summary = summarize(
        system, records, start_s, now, dep.num_devices, dep.hardware.price_per_hour, dep.weight_bytes,
        batch * max_len * dep.kv_bytes_per_token_device * dep.num_devices,
        kv_usage_max=usage_max, kv_usage_mean=usage_area / max(now - start_s, 1e-12), num_steps=len(step_times),
        prefill_tokens_computed=prefill, notes=f"batch {batch} x {max_len}-token reservation",
        extra={"static_batch_size": batch, "reserved_len": max_len},
    )
    records.sort(key=lambda r: r.arrival_s)
    return SimResult(summary, records, timeline, step_times)
