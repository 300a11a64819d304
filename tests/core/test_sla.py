"""SLA mode: the step-budget controller against a synthetic step-time model (no real model, no torch)."""

import math
import random

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.sla import BudgetController, QueuedPrefill
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from test_scheduler import Driver, make_sched

# "True" step time: a + b * tokens + c * sequences + d * context tokens (seconds), with +-3% noise.
TRUTH = (0.010, 0.00005, 0.0003, 0.0000005)


def synthetic_step(tokens, seqs, ctx, rng, truth=TRUTH):
    a, b, c, d = truth
    return (a + b * tokens + c * seqs + d * ctx) * rng.uniform(0.97, 1.03)


def p99(xs):
    xs = sorted(xs)
    return xs[math.ceil(0.99 * len(xs)) - 1]


def test_fits_the_step_time_model():
    ctrl = BudgetController(max_budget=2048, target_tpot_s=0.030)
    rng = random.Random(0)
    for _ in range(200):
        seqs = rng.randint(1, 48)
        tokens = seqs + rng.choice([0, 0, rng.randint(1, 2000)])  # decode-only steps and mixed ones
        ctx = seqs * rng.randint(50, 1500)
        ctrl.observe(tokens, synthetic_step(tokens, seqs, ctx, rng), seqs, ctx)
    for got, want in zip(ctrl.coefficients(), TRUTH):
        assert got == pytest.approx(want, rel=0.15)


def run_backlog(ctrl, decodes=(8, 32), steps=150, seed=0, prompt=150, gaps=1):
    """Decodes (a number drawn from ``decodes`` each step) and an endless backlog of prompts: the controller
    plans, the step runs at the synthetic cost, the controller observes. Returns the true step times.
    ``gaps=1``: the decodes have one inter-token gap, so every step must stay under the TPOT target."""
    rng = random.Random(seed)
    ctx_per_decode = 600
    times = []
    for _ in range(steps):
        num_decodes = rng.randint(*decodes)
        queue = [QueuedPrefill(prompt, 0.0) for _ in range(20)]
        budget = ctrl.plan(num_decodes, num_decodes, num_decodes * ctx_per_decode, queue, gaps)
        p = budget - num_decodes
        seqs = num_decodes + -(-p // prompt)
        ctx = num_decodes * ctx_per_decode + p
        t = synthetic_step(budget, seqs, ctx, rng)
        ctrl.observe(budget, t, seqs, ctx)
        times.append(t)
    return times


def test_converges_to_budgets_that_meet_the_tpot_target():
    ctrl = BudgetController(max_budget=2048, min_budget=80, target_tpot_s=0.040)
    times = run_backlog(ctrl)
    settled = times[30:]
    assert max(settled) <= 0.040  # every step, so every decode's TPOT, within the target ...
    assert sum(settled) / len(settled) >= 0.032  # ... without being needlessly timid (target x margin = 36 ms)
    # the per-sequence and context terms are in the model: more decodes leave less room for prefill
    queue = [QueuedPrefill(150, 0.0) for _ in range(20)]
    few = ctrl.plan(8, 8, 8 * 600, queue, 1) - 8
    many = ctrl.plan(32, 32, 32 * 600, queue, 1) - 32
    assert few > many + 200, (few, many)
    assert synthetic_step(32 + many, 32 + 1, 32 * 600 + many, random.Random(0)) <= 0.040
    # decodes with many output tokens average TPOT over them: room left by short steps allows a longer one
    ctrl.observe(40, 0.015, 40, 40 * 600)
    assert ctrl.plan(8, 8, 8 * 600, queue, 63) - 8 > few


def test_ttft_target_with_decodes_over_the_tpot_target_does_not_starve_prefills():
    # The old failure: 48 decodes alone take ~41 ms, over a 40 ms TPOT target, so the budget sat at the floor and
    # 150-token prompts were chunked over several steps, queueing behind each other.
    ctrl = BudgetController(max_budget=2048, min_budget=80, target_tpot_s=0.040, target_ttft_s=0.300)
    run_backlog(ctrl)  # learn the model
    assert ctrl.predict(48, 48, 48 * 600) > 0.040
    queue = [QueuedPrefill(150, 0.12), QueuedPrefill(150, 0.08), QueuedPrefill(150, 0.04)]
    budget = ctrl.plan(48, 48, 48 * 600, queue, 1)
    assert budget - 48 == 150 and ctrl.max_new_prefills == 1  # the least work that keeps TTFT: one prompt whole
    # a burst that arrived together a while ago: all three at once (the fastest way through the queue)
    queue = [QueuedPrefill(150, 0.2) for _ in range(3)]
    assert ctrl.plan(48, 48, 48 * 600, queue, 1) == 48 + 450 and ctrl.max_new_prefills == 3
    # with only a TPOT target the prompts wait at the floor instead (the decodes are over it already)
    tpot_only = BudgetController(max_budget=2048, min_budget=80, target_tpot_s=0.040)
    run_backlog(tpot_only)
    assert tpot_only.plan(48, 48, 48 * 600, queue, 1) == 80


def test_budget_stays_within_bounds():
    ctrl = BudgetController(max_budget=2048, min_budget=80, target_tpot_s=0.004)  # below any decode step
    run_backlog(ctrl)
    assert ctrl.budget() == 80
    loose = BudgetController(max_budget=512, target_tpot_s=10.0)
    run_backlog(loose)
    assert 512 - 150 < loose.budget() <= 512  # whole 150-token prompts up to the maximum
    assert loose.plan(16, 16, 16 * 600, []) == 512  # nothing waiting: the room a prompt would get
    with pytest.raises(ValueError):
        BudgetController(max_budget=100)


def test_scheduler_follows_the_controller():
    ctrl = BudgetController(max_budget=256, min_budget=16, target_tpot_s=0.020)
    sched = make_sched(1024, 4, 256, 8, 512, budget_controller=ctrl)
    drv = Driver(sched)
    rng = random.Random(0)
    now, first, last, count = 0.0, {}, {}, {}
    for step in range(200):
        if step < 40 and step % 2 == 0:  # distinct 120-token prompts, two every other step
            for j in range(2):
                rid = f"r{step}-{j}"
                sp = SamplingParams(temperature=0, max_tokens=16)
                sched.add_request(Request(rid, [rng.randrange(100, 30000) for _ in range(120)], sp, None, 16))
        if not sched.has_unfinished_requests():
            break
        so, outs = drv.step()
        assert so.num_batched_tokens <= sched.token_budget  # the budget planned for this step
        started = sum(1 for s in so.scheduled if s.num_computed_tokens == 0)
        if ctrl.max_new_prefills is not None:
            assert started <= ctrl.max_new_prefills
        shape = sched._step_shape
        assert shape[:2] == (so.num_batched_tokens, len(so.scheduled))
        dt = synthetic_step(*shape, rng)
        now += dt
        for o in outs:
            first.setdefault(o.req_id, now)
            last[o.req_id] = now
            count[o.req_id] = count.get(o.req_id, 0) + len(o.new_token_ids)
        sched.observe_step_time(so.num_batched_tokens, dt)
    assert not sched.has_unfinished_requests() and len(count) == 40
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in count]
    assert max(tpot) <= 0.020
    assert sched.stats().token_budget == sched.token_budget < 256


# ---------------------------------------------------------------------------- a simulated Poisson load
def simulate(budget=2048, target_ttft_s=None, target_tpot_s=None, rate=8.0, n=200, seed=0,
             prompt_lens=(64, 2048), output_lens=(4, 64), max_num_seqs=64):
    """Scheduler + synthetic step times on a simulated clock; returns p99 TTFT, p99 TPOT and the budgets in force
    while prompts were waiting."""
    rng = random.Random(seed)
    ctrl = None
    if target_ttft_s or target_tpot_s:
        ctrl = BudgetController(budget, min_budget=min(max_num_seqs + 16, budget),
                                target_tpot_s=target_tpot_s, target_ttft_s=target_ttft_s)
    sched = make_sched(8192, 16, budget, max_num_seqs, 4096, enable_caching=False, budget_controller=ctrl)
    now = 0.0
    sched.clock = lambda: now
    arrivals, t = [], 0.0
    lo, hi = math.log(prompt_lens[0]), math.log(prompt_lens[1])
    for i in range(n):
        t += rng.expovariate(rate)
        arrivals.append((t, f"r{i}", int(math.exp(rng.uniform(lo, hi))), rng.randint(*output_lens)))
    first, last, count = {}, {}, {}
    waiting_budgets = []
    nxt = 0
    while nxt < n or sched.has_unfinished_requests():
        while nxt < n and arrivals[nxt][0] <= now:
            at, rid, plen, olen = arrivals[nxt]
            sp = SamplingParams(temperature=0, max_tokens=olen, ignore_eos=True)
            sched.add_request(Request(rid, [7] * plen, sp, None, olen, arrival_time=at))
            nxt += 1
        if not sched.has_unfinished_requests():
            now = arrivals[nxt][0]
            continue
        queued = len(sched.waiting) > 0
        so = sched.schedule()
        if queued:
            waiting_budgets.append(sched.token_budget)
        dt = synthetic_step(*sched._step_shape, rng)
        now += dt
        sampled = {s.req_id: [11] for s in so.scheduled if s.sample}
        for o in sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled)):
            first.setdefault(o.req_id, now)
            last[o.req_id] = now
            count[o.req_id] = count.get(o.req_id, 0) + len(o.new_token_ids)
        sched.observe_step_time(so.num_batched_tokens, dt)
    assert len(first) == n and not sched.requests
    ttft = [first[rid] - at for at, rid, _, _ in arrivals]
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in count if count[r] > 1]
    return p99(ttft), p99(tpot), waiting_budgets, ctrl


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_poisson_load_meets_both_targets_where_fixed_budgets_do_not(seed):
    # ~8 requests/s, prompts 64..2048 tokens (log-uniform), 4..64 output tokens: servable, but long prompts
    # arriving together make big prefill steps.
    ttft_target, tpot_target = 0.600, 0.030
    ttft, tpot, budgets, ctrl = simulate(target_ttft_s=ttft_target, target_tpot_s=tpot_target, seed=seed)
    assert ttft <= ttft_target and tpot <= tpot_target, (ttft, tpot)
    assert 80 < sum(budgets) / len(budgets) < 2048
    for got, want in zip(ctrl.coefficients(), TRUTH):  # the scheduler feeds the step's shape to the fit
        assert got == pytest.approx(want, rel=0.25, abs=1e-7)
    # A fixed large budget prefills whatever waits in one step: good TTFT, but those steps break TPOT.
    large_ttft, large_tpot, _, _ = simulate(seed=seed)
    assert large_tpot > tpot_target
    # A fixed small budget (the old controller's floor) chunks prompts over many steps: TTFT far over the target.
    small_ttft, small_tpot, _, _ = simulate(budget=80, seed=seed)
    assert small_ttft > 2 * ttft_target and small_ttft > 2 * ttft


def test_ttft_target_alone_is_not_stuck_at_the_floor():
    ttft, _, budgets, _ = simulate(target_ttft_s=0.600, seed=0)
    assert ttft <= 0.600
    assert sum(budgets) / len(budgets) > 4 * 80  # prompts are admitted whole, not chunked at the floor


def test_without_chunked_prefill_every_request_finishes():
    ctrl = BudgetController(max_budget=512, min_budget=16, target_tpot_s=0.012)  # ~16 prefill tokens a step
    sched = make_sched(1024, 4, 512, 8, 512, enable_chunked_prefill=False, budget_controller=ctrl)
    drv = Driver(sched)
    rng = random.Random(0)
    for i in range(8):
        sp = SamplingParams(temperature=0, max_tokens=6)
        sched.add_request(Request(f"r{i}", [rng.randrange(100, 30000) for _ in range(100 + i)], sp, None, 6))
    while sched.has_unfinished_requests():
        so, _ = drv.step()
        assert not so.is_empty
        sched.observe_step_time(so.num_batched_tokens, synthetic_step(*sched._step_shape, rng))
    assert len(drv.finished) == 8


def test_the_engine_controller_comes_from_the_scheduler_config():
    assert BudgetController.from_config(SchedulerConfig()) is None  # no target: a fixed budget
    sched = make_sched(max_num_batched_tokens=512, max_num_seqs=8, target_tpot_ms=20, target_ttft_ms=500)
    ctrl = sched.budget_controller
    assert (ctrl.max_budget, ctrl.min_budget, ctrl.target_tpot_s, ctrl.target_ttft_s) == (512, 24, 0.020, 0.5)
    assert sched.stats().token_budget == sched.token_budget == 512  # the maximum until steps are measured


def test_budget_controller_needs_a_set_budget():
    """SLA mode plans under the step budget, so the config must have it set (the scheduler sets the default)."""
    with pytest.raises(ValueError, match="step budget is unset"):
        BudgetController.from_config(SchedulerConfig(target_ttft_ms=500))
    ctrl = BudgetController.from_config(SchedulerConfig(target_ttft_ms=500).with_budget_for(4096))
    assert ctrl.max_budget == 2048
