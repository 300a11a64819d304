"""The CPU a benchmark ran on: its model name and the ISA flags that decide which kernels are fast, for the
results' meta (numbers from different machines are only comparable knowing these)."""

from __future__ import annotations

import platform

from pagedllm import kernels

# x86: AVX2/FMA baseline, AVX-512 and its bf16/int8 dot products, AMX tiles; ARM: NEON (asimd on AArch64), SVE
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "neon", "asimd", "sve")


def parse_cpuinfo(text: str) -> dict:
    """{"model": str, "flags": [ISA flags present]} from the text of /proc/cpuinfo (first processor only)."""
    model, flags = kernels.parse_cpuinfo(text)
    return {"model": model, "flags": [f for f in ISA_FLAGS if f in flags]}


def cpu_info() -> dict:
    """This machine's CPU: {"model": name, "flags": ISA flags of ISA_FLAGS it has} (on AArch64 without listed
    features: neon/asimd, which every AArch64 CPU has)."""
    model, flags = kernels.cpu_info()
    info = {"model": model, "flags": [f for f in ISA_FLAGS if f in flags]}
    if not info["flags"] and platform.machine().lower() in ("arm64", "aarch64"):
        info["flags"] = ["neon", "asimd"]
    return info


def cpu_line(info: dict | None = None) -> str:
    """One line for a report: "AMD EPYC (avx2, fma, avx512f)"."""
    info = info if info is not None else cpu_info()
    return f"{info['model']} ({', '.join(info['flags']) or 'none of the listed ISA flags'})"
