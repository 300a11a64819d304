"""tools/scripts/run_bounds.py: the fastest a served run could be, from a file's arithmetic and bytes."""

import pytest

from pagedllm.config import default_model_path
from tools.scripts.run_bounds import bound_seconds, file_costs


def test_the_embedded_files_costs_are_its_matrices():
    """SmolLM2-135M (tied embedding): a prompt token's multiply-adds are its 30 layers' weights, a decoded token's
    add the 49152 x 576 head; a step reads every matrix once (the tied table once)."""
    c = file_costs(default_model_path())
    head = 49152 * 576
    layer = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536  # q, k, v; o; gate, up, down
    assert c["prefill_macs"] == 30 * layer and c["decode_macs"] == 30 * layer + head
    # Q4_1 blocks (20 bytes per 32 weights) and Q8_0 (34 per 32): between all of one and all of the other
    assert 20 / 32 * c["decode_macs"] < c["step_bytes"] < 34 / 32 * c["decode_macs"]


def test_the_bound_is_the_prefills_plus_the_steps():
    costs = {"prefill_macs": 1e9, "decode_macs": 2e9, "step_bytes": 10e9}  # 1 G / 2 G multiply-adds, 10 GB a step
    lens = [100, 300, 200, 400]
    # one at a time: 1000 prompt tokens at 100 G/s (10 s) and 4 x 5 steps of max(10 GB / 10 GB/s, 2 G / 100 G/s)
    t, ttft = bound_seconds(costs, lens, 5, 1, bandwidth=10, peak_gmacs=100)
    assert t == pytest.approx(10 + 20 * 1.0) and ttft == pytest.approx(2.5)
    # all four at once: the same prefills, 5 steps of max(1 s, 4 x 0.02 s); shortest first: 1, 3, 6, 10 s
    t, ttft = bound_seconds(costs, lens, 5, 4, bandwidth=10, peak_gmacs=100)
    assert t == pytest.approx(10 + 5 * 1.0) and ttft == pytest.approx((1 + 3 + 6 + 10) / 4)
    # compute-bound steps: 64 rows of 2 G at 100 G/s (1.28 s) beat the 1 s read
    t, _ = bound_seconds(costs, lens, 5, 64, bandwidth=10, peak_gmacs=100)
    assert t == pytest.approx(10 + 5 * 1.28)
