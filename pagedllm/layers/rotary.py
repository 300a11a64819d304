"""Rotary position embedding (Su et al. 2021), HuggingFace's half-split layout, with the frequency scalings models
ship: linear (position interpolation), Llama 3's per-band ``llama3``, llama.cpp's per-frequency divisors, Gemma 4's
``proportional`` (a fraction of the head's frequencies, the others zero) and YaRN
(a per-dimension blend of the original and interpolated frequencies, cos and sin times its attention factor), each
computed with transformers' float32 steps."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """(D/2,) float32 inverse frequencies, computed as transformers computes them (the same float32 steps)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "proportional":  # Gemma 4's full layers: the first frequencies of the whole head, the rest 0 (unturned)
        turned = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        return torch.cat([inv_freq[:turned], torch.zeros(head_dim // 2 - turned)])
    if kind == "factors":  # llama.cpp's rope_freqs tensor: each frequency divided by its factor
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":  # long wavelengths divided by factor, short ones kept, a smooth blend between
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":  # YaRN: per dimension, a ramp between the original frequency and the interpolated one
        factor, (low, high) = _yarn_factor(scaling), _yarn_range(head_dim, theta, scaling)
        pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        if low == high:
            high += 0.001  # as transformers: no division by zero
        ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    raise ValueError(f"unsupported rope scaling {kind!r}")


def _yarn_factor(scaling: dict) -> float:
    if scaling.get("factor") is not None:
        return float(scaling["factor"])
    return scaling["max_position_embeddings"] / scaling["original_max_position_embeddings"]


def _yarn_range(head_dim: int, theta: float, scaling: dict) -> tuple[float, float]:
    """The dimensions between which YaRN blends (transformers' ``find_correction_range``)."""
    def dim_of(rotations: float) -> float:
        return (head_dim * math.log(scaling["original_max_position_embeddings"] / (rotations * 2 * math.pi))) / (
            2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (``attention_factor``, else from ``factor``,
    ``mscale`` and ``mscale_all_dim`` as transformers infers it); 1 for the other scalings."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = _yarn_factor(scaling), scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_position: int, theta: float, device: torch.device, dtype: torch.dtype,
                 inv_freq: torch.Tensor | None = None, scale: float = 1.0):
        """``scale``: cos and sin multiplied by it in float32 (YaRN's attention factor, ``rope_attention_factor``)."""
        inv_freq = rope_inv_freq(head_dim, theta) if inv_freq is None else inv_freq
        pos = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # (P, D/2)
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin = sin.to(device=device, dtype=dtype)
        # float32 tables for the fused CPU kernel (it rotates in float32 and rounds once)
        self.cos32 = self.cos if dtype == torch.float32 else cos.to(device)
        self.sin32 = self.sin if dtype == torch.float32 else sin.to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (T, 1, D/2) tables, looked up once and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x: (T, H, D) -> rotated (T, H, D); tables narrower than D / 2 turn only the first dimensions (partial
        rotary: pairs i, i + R/2 of the first R), the rest pass."""
        cos, sin = cos_sin
        r = cos.shape[-1] * 2
        if r < x.shape[-1]:
            return torch.cat((RotaryEmbedding.apply(cos_sin, x[..., :r]), x[..., r:]), dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.apply(self.cos_sin(positions), x)
