"""GPTQ (Frantar et al. 2022): quantize a weight column by column and push each column's rounding error onto
the columns not yet quantized, weighted by the inverse Hessian of the layer's calibration inputs
(H = X^T X), so the layer's output error — not the weight error — is minimised.

Lazy batch updates over blocks of columns; group scales/zeros are taken from the (already error-updated) weights
of each group when the first column of the group is reached. No activation reordering."""

from __future__ import annotations

import torch

from pagedllm.quant.formats import QuantizedWeight, encode, group_params


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                  damp: float = 0.01, block: int = 128) -> tuple[QuantizedWeight, dict]:
    w = w.float().clone()
    n, k = w.shape
    if group_size <= 0:
        group_size = k
    block = max(block, group_size) if group_size < k else k
    block -= block % group_size
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += torch.eye(k, dtype=h.dtype) * damp * torch.diag(h).mean()
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()

    ng = k // group_size
    scales = torch.empty(n, ng)
    zeros = None if symmetric else torch.empty(n, ng)
    q_full = torch.empty_like(w)
    mid = 2 ** (bits - 1)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        w1 = w[:, b0:b1].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:
                g = col // group_size
                s, z = group_params(w1[:, i:i + group_size], bits, group_size, symmetric)
                scales[:, g] = s[:, 0]
                if zeros is not None:
                    zeros[:, g] = z[:, 0]
            g = col // group_size
            s = scales[:, g]
            z = 0.0 if zeros is None else zeros[:, g]
            q = (torch.round((w1[:, i] - z) / s) + mid).clamp(0, 2 ** bits - 1)
            dq = (q - mid) * s + z
            q_full[:, col] = dq
            e = (w1[:, i] - dq) / hinv1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, b1:] -= err1 @ hinv[b0:b1, b1:]
    codes = encode(q_full, scales, zeros, bits)
    return QuantizedWeight(codes, scales, zeros, bits, group_size), {"damp": damp}
