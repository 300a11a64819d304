"""The process's heap between steps: glibc's malloc options, and freed memory handed back to the system.

The start-up leaves freed memory in the heap that nothing reuses: the tokenizer's load (transformers' pickle and the
``tokenizers`` JSON it parses) frees ~55 MiB (Qwen2.5-Coder's 151k tokens) to ~180 MiB (Gemma 3's 262k) on its
thread's arena, and the weights' packing frees its temporaries; the steps' tensors are larger than the heap's
holes or come from mappings of their own, so those pages stayed resident for the server's life.
``release_freed_memory`` returns them (glibc's ``malloc_trim``) after the tokenizer loads and once the engine is
built (each call ~6 ms on the 1.5B; served peaks: docs/benchmarks.md, "Peak memory" on Zen 4)."""

from __future__ import annotations

import ctypes
import os

# glibc's malloc options (mallopt's parameter numbers) and what keep_freed_memory sets them to
_MALLOC_OPTIONS = {"MALLOC_MMAP_THRESHOLD_": (-3, 32 << 20), "MALLOC_TRIM_THRESHOLD_": (-1, 1 << 30),
                   "MALLOC_TOP_PAD_": (-2, 64 << 20)}


def keep_freed_memory() -> bool:
    """Let glibc keep freed memory for the next step instead of returning it to the system. By default a block of
    over 128 KiB-32 MiB is its own mmap, unmapped on free: a step's activations (MiBs per layer) then come back as
    fresh pages, each zeroed by the kernel on its first touch (a page fault per 4 KiB: 10% of a 32-request run's
    time on the 1.5B model). Blocks up to 32 MiB now come from the heap, which keeps up to 1 GiB free at its top: the
    resident memory after a busy step stays near that step's peak (SmolLM2 after 32 requests: 675 against 600 MiB
    with glibc's defaults). A ``MALLOC_*_`` variable the user set wins; elsewhere than glibc, nothing changes.
    Returns whether the options were set."""
    if any(name in os.environ for name in _MALLOC_OPTIONS):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in _MALLOC_OPTIONS.values())


def release_freed_memory() -> bool:
    """Return the heap's free pages to the system (glibc's ``malloc_trim(0)``: the whole free pages inside every
    arena's free chunks, a thread's arena included, and the main arena's top), whatever the trim threshold
    (``keep_freed_memory`` raises it for the steps' sake). Thread-safe (glibc locks each arena in turn). Returns
    whether it ran (elsewhere than glibc: nothing to call)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
