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


def test_the_bound_is_the_longer_of_the_arithmetic_and_the_reads():
    costs = {"prefill_macs": 1e9, "decode_macs": 2e9, "step_bytes": 10e9}  # per token: 1 G / 2 G; 10 GB a pass
    lens = [100, 300, 200, 400]  # at 100 G/s: prefills of 1, 3, 2, 4 s (and 0.01 s for the first token's head row)
    # one at a time, each pass the longer of its read (1 s at 10 GB/s) and its arithmetic: the prefills (+ head
    # row) 10.04 s, then 4 x 4 steps of max(1 s, 0.02 s); a first token waits for its own prefill
    t, ttft = bound_seconds(costs, lens, 5, 1, bandwidth=10, peak_gmacs=100)
    assert t == pytest.approx(10.04 + 16 * 1.0) and ttft == pytest.approx(2.5)
    # all four at once: 5 passes (5 s of reads) against 10 s of prefill + 4 x (0.01 + 4 x 0.02) s of steps; the
    # first tokens at best after 1, 1 + 2, 1 + 2 + 3 and 1 + 2 + 3 + 4 s
    t, ttft = bound_seconds(costs, lens, 5, 4, bandwidth=10, peak_gmacs=100)
    assert t == pytest.approx(10.36) and ttft == pytest.approx((1 + 3 + 6 + 10) / 4)
    assert bound_seconds(costs, lens, 5, 64, bandwidth=10, peak_gmacs=100) == (t, ttft)  # no more than N in flight
    # reads bound it when the file is large: 100 GB a pass, 2 waves of 2 x 5 passes
    t, _ = bound_seconds({**costs, "step_bytes": 100e9}, lens, 5, 2, bandwidth=10, peak_gmacs=100)
    assert t == pytest.approx(2 * 5 * 10.0)


def test_a_mixture_of_experts_counts_its_active_experts(tmp_path):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "qwen3moe")
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((8, 32, 16), np.float32))  # 8 experts of 16 -> 32
    w.add_tensor("blk.0.attn_q.weight", np.zeros((16, 16), np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.zeros(16, np.float32))
    w.add_tensor("token_embd.weight", np.zeros((100, 16), np.float32))  # tied head
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    c = file_costs(str(tmp_path / "moe.gguf"))
    layers = 2 * 32 * 16 + 16 * 16  # 2 of the 8 experts, and q
    assert c["prefill_macs"] == layers and c["decode_macs"] == layers + 100 * 16
    assert c["step_bytes"] == 4 * (layers + 100 * 16)  # float32
