"""Hardware profiles: peak throughput per number format, memory bandwidth and size, interconnect, and the
attainable fractions of them the cost model uses.

GPU numbers are NVIDIA datasheet figures for dense math (no 2:4 sparsity); memory sizes are what ``nvidia-smi``
reports as total. They are uncalibrated: no GPU was measured for them (see docs/simulate.md). The CPU profile of
this machine is built from ``pagedllm bench roofline`` output by ``pagedllm.sim.calibrate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import MappingProxyType

GIB = 1 << 30
MIB = 1 << 20

COMPUTE_DTYPES = ("fp32", "bf16", "fp8", "int8")


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator (or one CPU socket) and its link to the others of a tensor-parallel group.

    Peaks are FLOP/s (int8: OP/s) for dense matrix math; 0 means the format has no native path (the cost model
    then computes in bf16). Bandwidths are bytes/s; ``interconnect_bw`` is per direction per device, the figure
    a ring all-reduce moves data at.
    """

    name: str
    description: str
    fp32_flops: float
    bf16_flops: float
    fp8_flops: float
    int8_flops: float
    memory_bw: float
    memory_bytes: int
    interconnect_bw: float
    interconnect_latency_s: float  # per ring hop
    compute_efficiency: float = 0.65  # attainable fraction of peak for large GEMMs
    bandwidth_efficiency: float = 0.8  # attainable fraction of memory bandwidth for streaming reads
    interconnect_efficiency: float = 0.7
    attention_efficiency: float = 0.5  # attention kernels' attainable fraction of the compute peak
    # measured GEMM efficiency by row count, (rows, fraction of the compute peak), interpolated in log2(rows);
    # empty: compute_efficiency at every size (the memory roofline covers small row counts)
    gemm_efficiency_curve: tuple[tuple[int, float], ...] = ()
    step_overhead_s: float = 0.003  # scheduling, input preparation, kernel launches: per step
    seq_overhead_s: float = 20e-6  # per scheduled sequence (block tables, sampling, output processing)
    token_overhead_s: float = 0.0  # per token row (elementwise kernels not in the roofline groups)
    activation_bytes: int = 2  # activations between layers (bf16 on GPU, fp32 on this CPU's default path)
    attention_dtype: str = "bf16"
    default_kv_dtype: str = "bf16"
    activation_reserve_bytes: int = 2 * GIB  # per device: CUDA context, workspaces, activations of a step
    price_per_hour: float = 0.0  # $ per device-hour (illustrative on-demand price; override it)
    calibrated: bool = False
    source: str = "datasheet"

    def __post_init__(self) -> None:
        for f in ("fp32_flops", "bf16_flops", "memory_bw", "interconnect_bw"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{self.name}: {f} must be > 0, got {getattr(self, f)!r}")
        for f in ("fp8_flops", "int8_flops", "interconnect_latency_s", "step_overhead_s", "seq_overhead_s",
                  "token_overhead_s", "price_per_hour"):
            if getattr(self, f) < 0:
                raise ValueError(f"{self.name}: {f} must be >= 0, got {getattr(self, f)!r}")
        for f in ("compute_efficiency", "bandwidth_efficiency", "interconnect_efficiency", "attention_efficiency"):
            v = getattr(self, f)
            if not 0 < v <= 1:
                raise ValueError(f"{self.name}: {f} must be in (0, 1], got {v!r}")
        if self.memory_bytes <= 0:
            raise ValueError(f"{self.name}: memory_bytes must be > 0")
        if self.activation_bytes not in (1, 2, 4):
            raise ValueError(f"{self.name}: activation_bytes must be 1, 2 or 4, got {self.activation_bytes}")
        if self.activation_reserve_bytes < 0:
            raise ValueError(f"{self.name}: activation_reserve_bytes must be >= 0")
        if self.attention_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"{self.name}: attention_dtype must be one of {COMPUTE_DTYPES}")
        rows = [r for r, _ in self.gemm_efficiency_curve]
        if rows != sorted(set(rows)) or any(r < 1 for r in rows):
            raise ValueError(f"{self.name}: gemm_efficiency_curve rows must be increasing and >= 1")
        if any(not 0 < e <= 1 for _, e in self.gemm_efficiency_curve):
            raise ValueError(f"{self.name}: gemm_efficiency_curve fractions must be in (0, 1]")

    def peak_flops(self, dtype: str) -> float:
        """Peak of a compute format; formats without a native path fall back to bf16."""
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"unknown compute dtype {dtype!r}; known: {COMPUTE_DTYPES}")
        v = getattr(self, f"{dtype}_flops")
        return v if v > 0 else self.bf16_flops

    def native(self, dtype: str) -> bool:
        return getattr(self, f"{dtype}_flops") > 0

    def gemm_efficiency(self, rows: int) -> float:
        """Attainable fraction of the compute peak for a GEMM with ``rows`` activation rows."""
        curve = self.gemm_efficiency_curve
        if not curve:
            return self.compute_efficiency
        if rows <= curve[0][0]:
            return curve[0][1]
        if rows >= curve[-1][0]:
            return curve[-1][1]
        x = math.log2(rows)
        for (r0, e0), (r1, e1) in zip(curve, curve[1:]):
            if rows <= r1:
                t = (x - math.log2(r0)) / (math.log2(r1) - math.log2(r0))
                return e0 + t * (e1 - e0)
        return curve[-1][1]  # unreachable

    @property
    def attainable_bw(self) -> float:
        return self.memory_bw * self.bandwidth_efficiency

    def with_overrides(self, **kw) -> "HardwareProfile":
        """A copy with some fields changed (None values are ignored); validated again."""
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


# Datasheet figures (dense). A100: no fp8 tensor cores. Interconnect: NVLink per direction per GPU
# (A100 NVLink 3: 600 GB/s total; H100/H200 NVLink 4: 900 GB/s total); L40S has no NVLink: PCIe Gen4 x16.
_GPUS = (
    HardwareProfile(
        name="a100-80gb", description="NVIDIA A100 80GB SXM (HBM2e, NVLink 3)",
        fp32_flops=19.5e12, bf16_flops=312e12, fp8_flops=0.0, int8_flops=624e12,
        memory_bw=2.039e12, memory_bytes=81920 * MIB, interconnect_bw=300e9, interconnect_latency_s=5e-6,
        price_per_hour=2.00,
    ),
    HardwareProfile(
        name="h100-80gb", description="NVIDIA H100 80GB SXM5 (HBM3, NVLink 4)",
        fp32_flops=67e12, bf16_flops=989.4e12, fp8_flops=1978.9e12, int8_flops=1978.9e12,
        memory_bw=3.35e12, memory_bytes=81559 * MIB, interconnect_bw=450e9, interconnect_latency_s=5e-6,
        price_per_hour=3.00,
    ),
    HardwareProfile(
        name="h200", description="NVIDIA H200 141GB SXM (HBM3e, NVLink 4)",
        fp32_flops=67e12, bf16_flops=989.4e12, fp8_flops=1978.9e12, int8_flops=1978.9e12,
        memory_bw=4.8e12, memory_bytes=143771 * MIB, interconnect_bw=450e9, interconnect_latency_s=5e-6,
        price_per_hour=3.80,
    ),
    HardwareProfile(
        name="l40s", description="NVIDIA L40S 48GB (GDDR6, PCIe Gen4 x16, no NVLink)",
        fp32_flops=91.6e12, bf16_flops=362.05e12, fp8_flops=733e12, int8_flops=733e12,
        memory_bw=864e9, memory_bytes=46068 * MIB, interconnect_bw=32e9, interconnect_latency_s=10e-6,
        price_per_hour=1.00,
    ),
)

GPU_PROFILES = MappingProxyType({p.name: p for p in _GPUS})
ALIASES = MappingProxyType({"a100": "a100-80gb", "h100": "h100-80gb", "h100-sxm": "h100-80gb",
                            "h100-80gb-sxm": "h100-80gb", "h200-141gb": "h200"})


def get_gpu_profile(name: str) -> HardwareProfile:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in GPU_PROFILES:
        raise ValueError(f"unknown GPU {name!r}; known: {sorted(GPU_PROFILES)} (or cpu-local with --calibrate)")
    return GPU_PROFILES[key]
