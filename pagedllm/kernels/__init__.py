"""Fused CPU kernels (``cpu_ops.cpp``), compiled on first use with torch's C++ extension loader.

The build happens once per machine and source version (cached under torch's extensions directory; about a
minute with 2 cores) and needs a C++ compiler. Without one, or with ``PAGEDLLM_CPU_KERNELS=0``, ``cpu_ops()``
returns None and the model runs the same math as separate torch operations.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")


def _cpu_tag() -> str:
    """A short hash of this CPU's model and feature flags (a shared extensions cache must not hand a build to a
    CPU that lacks its instructions)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        import platform

        lines = [platform.processor(), platform.machine()]
    return hashlib.sha1("".join(lines).encode()).hexdigest()[:10]


@functools.cache
def cpu_ops():
    """The compiled module (decode_attention, rms_norm, add_rms_norm, rope_write_kv, silu_and_mul), or None."""
    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name=f"pagedllm_cpu_ops_{_cpu_tag()}",  # -march=native: a build is only reused on the same CPU kind
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, or a failed build: the torch path still works
        logger.warning("fused CPU kernels unavailable (%s: %s); using plain torch operations",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
