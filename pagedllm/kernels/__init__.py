"""Fused CPU kernels (``cpu_ops.cpp``), compiled on first use with torch's C++ extension loader.

The build happens once per machine and source version (cached under torch's extensions directory; about a
minute with 2 cores) and needs a C++ compiler. Without one, or with ``PAGEDLLM_CPU_KERNELS=0``, ``cpu_ops()``
returns None and the model runs the same math as separate torch operations.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")


@functools.cache
def cpu_ops():
    """The compiled module (decode_attention, rms_norm, add_rms_norm, rope_write_kv, silu_and_mul), or None."""
    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="pagedllm_cpu_ops",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, or a failed build: the torch path still works
        logger.warning("fused CPU kernels unavailable (%s: %s); using plain torch operations",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
