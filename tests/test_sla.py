"""SLA mode: the step-budget controller against a synthetic step-time model (no real model)."""

import random

import pytest

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sla import BudgetController
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from test_core_scheduler import Driver


def synthetic_step(tokens, rng, a=0.005, b=0.0001):
    return (a + b * tokens) * rng.uniform(0.97, 1.03)


def run_controller(ctrl, steps=60, demand=2000, seed=0):
    rng = random.Random(seed)
    for _ in range(steps):
        tokens = min(ctrl.budget(), demand)
        ctrl.observe(tokens, synthetic_step(tokens, rng))
    return ctrl.budget()


def test_converges_to_the_tpot_target():
    ctrl = BudgetController(max_budget=2048, target_tpot_s=0.030)
    budget = run_controller(ctrl)
    assert 235 <= budget <= 265, budget  # (30 ms - 5 ms) / 0.1 ms per token = 250
    assert synthetic_step(budget, random.Random(1)) <= 0.030 * 1.05
    a, b = ctrl.model()
    assert a == pytest.approx(0.005, abs=0.002) and b == pytest.approx(0.0001, rel=0.1)


def test_ttft_only_target_keeps_steps_under_a_quarter_of_it():
    budget = run_controller(BudgetController(max_budget=2048, target_ttft_s=0.200))
    assert 420 <= budget <= 480, budget  # step <= 50 ms -> 450 tokens


def test_budget_stays_within_bounds():
    assert run_controller(BudgetController(max_budget=2048, min_budget=80, target_tpot_s=0.004)) == 80
    assert run_controller(BudgetController(max_budget=512, target_tpot_s=10.0)) == 512
    with pytest.raises(ValueError):
        BudgetController(max_budget=100)


def test_scheduler_follows_the_controller():
    ctrl = BudgetController(max_budget=256, min_budget=8, target_tpot_s=0.010)
    sched = Scheduler(KVCacheManager(512, 4), 256, 8, 512, True, budget_controller=ctrl)
    drv = Driver(sched)
    for i in range(6):
        sp = SamplingParams(temperature=0, max_tokens=8)
        sched.add_request(Request(f"r{i}", [100 + j for j in range(120)], sp, None, 8))
    rng = random.Random(0)
    budgets = []
    while sched.has_unfinished_requests():
        in_force = sched.token_budget
        so, _ = drv.step()
        assert so.num_batched_tokens <= in_force
        budgets.append(in_force)
        sched.observe_step_time(so.num_batched_tokens, synthetic_step(so.num_batched_tokens, rng))
    assert budgets[0] == 256 and budgets[-1] < 60  # (10 ms - 5 ms) / 0.1 ms = 50 tokens
    assert sched.stats().token_budget == sched.token_budget
