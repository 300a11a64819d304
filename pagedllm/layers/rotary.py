"""Rotary position embedding (Su et al. 2021), HuggingFace's half-split layout."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_position: int, theta: float, device: torch.device, dtype: torch.dtype):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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
