"""The runner's malloc options: freed activations stay in the heap for the next step."""

import ctypes
import platform

import pytest

from pagedllm.worker.heap import _MALLOC_OPTIONS, keep_freed_memory, release_freed_memory


class MallInfo2(ctypes.Structure):  # glibc 2.33+'s struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _steps_options(monkeypatch):
    """The engine's malloc options for its steps set (no user variable in the way); libc with malloc / free typed."""
    for name in _MALLOC_OPTIONS:
        monkeypatch.delenv(name, raising=False)
    assert keep_freed_memory() is True
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_keep_freed_memory_sets_glibc_options_unless_the_user_did(monkeypatch):
    libc = _steps_options(monkeypatch)
    # a block of 16 MiB now comes from the heap, not from an mmap of its own (glibc's default for it: unmapped on
    # free, its pages zeroed again on the next step's first touch)
    if hasattr(libc, "mallinfo2"):  # glibc 2.33+ (before it, the options are set but their effect not readable)
        libc.mallinfo2.restype = MallInfo2
        mapped = libc.mallinfo2().hblkhd
        block = libc.malloc(16 << 20)
        assert libc.mallinfo2().hblkhd == mapped
        libc.free(block)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")  # the user's choice wins: nothing is changed
    assert keep_freed_memory() is False


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_release_freed_memory_hands_back_what_the_heap_kept(monkeypatch):
    """Under the steps' options (freed memory kept in the heap), 96 MiB written and freed stays resident until
    ``release_freed_memory`` (what the engine calls after the tokenizer and the weights load) hands it back."""
    libc = _steps_options(monkeypatch)
    blocks = [libc.malloc(2 << 20) for _ in range(48)]  # heap blocks (under the 32 MiB mmap threshold)
    for b in blocks:
        ctypes.memset(b, 1, 2 << 20)
    for b in blocks:
        libc.free(b)
    kept = _rss_kib()
    assert release_freed_memory() is True
    assert kept - _rss_kib() > 64 * 1024


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(platform.system() != "Linux", reason="/proc/self/status, anonymous mappings")
def test_kv_tensors_are_zero_and_committed_only_when_written():
    """The CPU KV cache: zero-filled views of one mapping in small pages, resident only as far as written (a 256 MiB
    budget costs nothing until blocks are used), alive after the call that made them; no transparent huge pages
    for it (their first touch cost ~12 ms each on the Sapphire Rapids VM)."""
    import torch

    from pagedllm.worker.kv_cache import zeros

    before = _rss_kib()
    k, v = zeros((1024, 16, 2, 1024), torch.bfloat16, torch.device("cpu"), count=2)  # 2 x 64 MiB
    assert k.shape == v.shape == (1024, 16, 2, 1024) and k.dtype == torch.bfloat16
    assert _rss_kib() - before < 16 * 1024
    k[:8].fill_(1.0)  # 8 blocks of 64 KiB written
    assert _rss_kib() - before < 16 * 1024
    assert float(k[8:].abs().sum()) == 0.0 and float(v.abs().sum()) == 0.0 and float(k[:8].sum()) == 8 * 16 * 2048
    with open("/proc/self/smaps") as f:  # the mapping holding k: marked "nh" (no huge pages)
        lines = f.read().splitlines()
    start = k.data_ptr()
    for i, line in enumerate(lines):
        lo, _, hi = line.split(" ", 1)[0].partition("-")
        if hi and all(c in "0123456789abcdef" for c in lo + hi) and int(lo, 16) <= start < int(hi, 16):
            break
    flags = next(line for line in lines[i + 1:] if line.startswith("VmFlags:"))
    assert "nh" in flags.split(), flags
