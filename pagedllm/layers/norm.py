"""RMSNorm (Zhang & Sennrich 2019), computed in float32 like the reference implementation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x normalized in float32, times the weight. A weight in x's 16-bit dtype multiplies the normalized x rounded to
    that dtype (HF's llama: ``weight * x.to(dtype)``); a float32 weight multiplies it in float32, rounded once (HF's
    gemma: ``x * (1 + w.float())``, whose 1 + w the loader has already added)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op; the same float32 arithmetic
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (xf * weight).to(x.dtype)
    return weight * xf.to(x.dtype)
