"""`pagedllm bench roofline`'s measurements that the simulator's calibration reads."""

import torch


def test_layer_linears_timed_as_the_engine_built_them(llm):
    """One forward of the decoder layers' linears at each row count, through the linears the engine holds (the
    simulator's GEMM curve, ``layer_linears_ms``): more rows take longer, not proportionally (one row streams the
    weights, many rows compute)."""
    from pagedllm.bench.roofline import layer_linear_rows

    model = llm.engine.runner.model
    ms = layer_linear_rows(model, torch.float32, rows=(1, 64))
    assert sorted(ms) == [1, 64] and 0 < ms[1] < ms[64] < 64 * ms[1]
