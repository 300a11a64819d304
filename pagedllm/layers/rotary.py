"""Rotary position embedding (Su et al. 2021), HuggingFace's half-split layout, with the frequency scalings models
ship: linear (position interpolation), Llama 3's per-band ``llama3`` and llama.cpp's per-frequency divisors."""

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
    raise ValueError(f"unsupported rope scaling {kind!r}")


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_position: int, theta: float, device: torch.device, dtype: torch.dtype,
                 inv_freq: torch.Tensor | None = None):
        inv_freq = rope_inv_freq(head_dim, theta) if inv_freq is None else inv_freq
        pos = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # (P, D/2)
        self.cos = freqs.cos().to(device=device, dtype=dtype)
        self.sin = freqs.sin().to(device=device, dtype=dtype)
        # float32 tables for the fused CPU kernel (it rotates in float32 and rounds once)
        self.cos32 = self.cos if dtype == torch.float32 else freqs.cos().to(device)
        self.sin32 = self.sin if dtype == torch.float32 else freqs.sin().to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (T, 1, D/2) tables, looked up once and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x: (T, H, D) -> rotated (T, H, D)."""
        cos, sin = cos_sin
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.apply(self.cos_sin(positions), x)
