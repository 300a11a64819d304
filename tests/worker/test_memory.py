"""The runner's malloc options: freed activations stay in the heap for the next step."""

import ctypes
import platform

import pytest

from pagedllm.worker.model_runner import _MALLOC_OPTIONS, keep_freed_memory


class MallInfo2(ctypes.Structure):  # glibc 2.33+'s struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_keep_freed_memory_sets_glibc_options_unless_the_user_did(monkeypatch):
    for name in _MALLOC_OPTIONS:
        monkeypatch.delenv(name, raising=False)
    assert keep_freed_memory() is True
    # a block of 16 MiB now comes from the heap, not from an mmap of its own (glibc's default for it: unmapped on
    # free, its pages zeroed again on the next step's first touch)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = MallInfo2
    mapped = libc.mallinfo2().hblkhd
    block = libc.malloc(16 << 20)
    assert libc.mallinfo2().hblkhd == mapped
    libc.free(block)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")  # the user's choice wins: nothing is changed
    assert keep_freed_memory() is False
