"""Calibration statistics: what each linear layer sees on sample text.

Every fused linear of the full-precision model is wrapped by a recorder while calibration sequences run through
it; the recorder keeps the mean |x| per input channel (AWQ's salience), ``X^T X`` (GPTQ's Hessian, up to a
constant) and a random subsample of input rows (to score AWQ's candidate scalings)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from pagedllm.model.scoring import sequence_hidden


@dataclass
class LinearStats:
    in_features: int
    want_hessian: bool
    max_rows: int
    seed: int
    abs_sum: torch.Tensor = field(init=False)
    hessian: torch.Tensor | None = field(init=False)
    rows: list[torch.Tensor] = field(default_factory=list)
    count: int = 0

    def __post_init__(self) -> None:
        self.abs_sum = torch.zeros(self.in_features, dtype=torch.float64)
        self.hessian = torch.zeros(self.in_features, self.in_features, dtype=torch.float64) \
            if self.want_hessian else None
        self._gen = torch.Generator().manual_seed(self.seed)

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().float().reshape(-1, self.in_features).cpu()
        self.abs_sum += x.abs().sum(0).double()
        if self.hessian is not None:
            self.hessian += (x.T @ x).double()
        self.count += x.shape[0]
        take = min(x.shape[0], max(self.max_rows // 8, 1))
        idx = torch.randperm(x.shape[0], generator=self._gen)[:take]
        self.rows.append(x[idx])

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(self.count, 1)).float()

    def sample_rows(self) -> torch.Tensor:
        rows = torch.cat(self.rows)
        if rows.shape[0] > self.max_rows:
            idx = torch.randperm(rows.shape[0], generator=self._gen)[: self.max_rows]
            rows = rows[idx]
        return rows


class _Recorder:
    def __init__(self, linear, stats: LinearStats) -> None:
        self.linear, self.stats = linear, stats

    def __call__(self, x):
        self.stats.add(x)
        return self.linear(x)


def collect_stats(model, sequences: list[list[int]], names: list[str], want_hessian: bool,
                  max_rows: int = 1024) -> dict[str, LinearStats]:
    """Run ``sequences`` through ``model`` recording the inputs of the named fused linears
    (``layers.{i}.{qkv,o,gate_up,down}``)."""
    stats: dict[str, LinearStats] = {}
    slots = {n: (owner, attr) for n, owner, attr in model.linear_slots()}  # where each linear sits in the model
    originals = {n: getattr(*slots[n]) for n in names}
    for n, lin in originals.items():
        stats[n] = LinearStats(lin.in_features, want_hessian, max_rows, seed=len(stats))
        setattr(*slots[n], _Recorder(lin, stats[n]))
    try:
        for seq in tqdm(sequences, desc="calibration", unit="seq", leave=False):
            sequence_hidden(model, seq)
    finally:
        for n, lin in originals.items():
            setattr(*slots[n], lin)
    return stats
