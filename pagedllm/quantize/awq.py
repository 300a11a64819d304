"""AWQ (activation-aware weight quantization, Lin et al. 2023): protect the input channels that see large
activations by scaling them up before quantizing, and scaling the activations down by the same factor.

For a linear W (N, K) with calibration inputs X: ``y = X W^T = (X / s) (W * s)^T``. Channels with large mean |x|
get s > 1, so their weights use more of the quantization grid. s = mean|x| ** alpha (normalised), with alpha chosen
on a grid to minimise the output error ``||X W^T - X Q(W * s)^T / s||`` on the calibration rows. The layer keeps
``1/s`` as a per-channel input multiplier (one elementwise op) instead of folding it into the previous layer, which
keeps every projection independent (also for grouped-query attention, where folding into v is not exact)."""

from __future__ import annotations

import torch

from pagedllm.quant.formats import QuantizedWeight, dequantize, quantize_rtn
from pagedllm.quantize.calibrate import LinearStats


def awq_quantize(w: torch.Tensor, stats: LinearStats, bits: int, group_size: int, symmetric: bool,
                 grid: int = 20) -> tuple[QuantizedWeight, dict]:
    w = w.float()
    x = stats.sample_rows()
    ref = x @ w.T
    act = stats.mean_abs.clamp_min(1e-6)
    best = None
    for i in range(grid + 1):
        alpha = i / grid
        s = act.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        qw = quantize_rtn(w * s, bits, group_size, symmetric)
        qw.input_scale = s
        err = ((x @ dequantize(qw).T - ref) ** 2).mean().item()
        if best is None or err < best[0]:
            best = (err, alpha, qw)
    rtn_err = ((x @ dequantize(quantize_rtn(w, bits, group_size, symmetric)).T - ref) ** 2).mean().item()
    err, alpha, qw = best
    if alpha == 0.0:
        qw.input_scale = None  # plain round-to-nearest won: no scaling needed
    return qw, {"alpha": alpha, "output_mse": err, "rtn_output_mse": rtn_err}
