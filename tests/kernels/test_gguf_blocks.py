"""Every GGUF block type the engine runs natively (``quant.gguf_blocks``): random blocks (any byte pattern is a
valid block; only the float16 scales are set to finite values) decode to exactly ``gguf.quants.dequantize``'s
numbers, the block kernel computes x W^T of those numbers on every instruction-set path this CPU runs, a tiny GGUF
file with one tensor of each type runs through the whole engine, and the start-up log counts the native tensors."""

from __future__ import annotations

import dataclasses
import re
import sys

import gguf
import numpy as np
import pytest
import torch

from pagedllm.quant.formats import concat, dequantize
from pagedllm.gguf_file import BLOCK_TYPES
from pagedllm.quant.gguf_blocks import DECODERS, FAST_CODES, K_SCALED, PLAIN_CODES, decode, k_scaled
from helpers import model_of

# byte offsets of each type's float16 fields in a block (set to finite random values)
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "MXFP4": (),
}
E8M0_FIELDS = {"MXFP4": 0}  # byte offset of a block's E8M0 scale (set to 2^-10 .. 2^-1: finite products)


def random_blocks(kind: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """(rows, bytes per row) uint8: random codes and sub-scales, float16 scales ~ N(0, 0.02) (no inf/NaN)."""
    qt = gguf.GGMLQuantizationType[kind]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * (k // block), nbytes), dtype=np.uint8)
    for off in F16_FIELDS[kind]:
        raw[:, off:off + 2] = (rng.standard_normal(len(raw)) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if kind in E8M0_FIELDS:
        raw[:, E8M0_FIELDS[kind]] = rng.integers(118, 128, size=len(raw))
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]),
                                       dtype=np.float32))


def test_every_listed_type_has_a_decoder_and_a_test():
    assert set(DECODERS) == set(F16_FIELDS) == set(BLOCK_TYPES)


@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES))
def test_the_block_types_table_is_the_files_and_the_decoders(kind):
    """``gguf_file.BLOCK_TYPES``, the one table of a block type's facts: its geometry is gguf's, its code width,
    group and two-level scales are what its decoder gives, the loader's own float path covers its header bytes."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    t = BLOCK_TYPES[kind]
    assert GGML_QUANT_SIZES[GGMLQuantizationType[kind]] == (t.values, t.nbytes)
    qw = decode(random_blocks(kind, 8, 512), kind)
    assert (qw.bits, qw.group_size, qw.kscales is not None) == (t.code_bits, t.group, t.k_scaled)
    assert (kind in FAST_CODES) == (t.decoder > 0)
    assert t.head == 0 or (t.values == 32 and t.nbytes - t.head in (16, 32))


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_decoded_values_equal_gguf_bit_for_bit(kind):
    raw = random_blocks(kind, 24, 512)
    qw = decode(raw, kind)
    ref = reference(raw, kind)
    assert qw.shape == tuple(ref.shape)
    assert torch.equal(dequantize(qw), ref)
    if kind in E8M0_FIELDS:  # every E8M0 scale up to 2^123 (the subnormal halves 0 and 1 included); past it (a
        # weight of 2^126 and more) the file is refused with the reason, not read as inf or nan
        from pagedllm.quant.gguf_blocks import MXFP4_MAX_E8M0

        raw = random_blocks(kind, MXFP4_MAX_E8M0 + 1, 32, seed=1)
        raw[:, E8M0_FIELDS[kind]] = np.arange(MXFP4_MAX_E8M0 + 1)
        assert torch.equal(dequantize(decode(raw, kind)), reference(raw, kind))
        raw[-1, E8M0_FIELDS[kind]] = MXFP4_MAX_E8M0 + 1
        with pytest.raises(ValueError, match="out of range"):
            decode(raw, kind)


@pytest.mark.parametrize("kind", sorted(FAST_CODES))
def test_kernel_decoded_codes_equal_numpy_decoders(kind, monkeypatch):
    """The kernels' one-pass decoding of these types' codes and K-quant sub-scales (``gguf_codes``,
    ``gguf_k_scales``: what a start-up runs) gives the numpy decoders' codes and scales (the path without the
    kernels); the test above checks the values against gguf's. Rows past ``CHUNK_ROWS`` (the scales' chunks, the
    codes in one pass into the result) are covered by shrinking the chunk."""
    import pagedllm.quant.gguf_blocks as gb

    raw = random_blocks(kind, 24, 512, seed=3)
    monkeypatch.setattr(gb, "CHUNK_ROWS", 16)
    fast = decode(raw, kind)
    monkeypatch.setattr(gb, "cpu_ops", lambda: None)
    slow = decode(raw, kind)
    assert fast.codes.dtype == slow.codes.dtype == torch.uint8 and torch.equal(fast.codes, slow.codes)
    assert torch.equal(fast.scales, slow.scales)
    assert (fast.zeros is None) == (slow.zeros is None) and (fast.zeros is None or torch.equal(fast.zeros, slow.zeros))
    assert (fast.kscales is None) == (slow.kscales is None)
    if fast.kscales is not None:
        for a, b in zip(dataclasses.astuple(fast.kscales), dataclasses.astuple(slow.kscales)):
            assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(dequantize(fast), dequantize(slow))
    from pagedllm.kernels import cpu_ops

    t = BLOCK_TYPES[kind]
    values, nbytes = t.values, t.nbytes
    with pytest.raises(RuntimeError, match="not whole"):
        cpu_ops().gguf_codes(raw.reshape(-1)[:-1], t.kernel_type(), torch.empty(raw.size // nbytes * values,
                                                                                 dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="out must be"):
        cpu_ops().gguf_codes(raw.reshape(-1), t.kernel_type(), torch.empty(raw.size // nbytes * values - 1,
                                                                          dtype=torch.uint8))
    wrong = dataclasses.replace(t, nbytes=t.nbytes + 2)  # a row that disagrees with the decoder's own layout
    with pytest.raises(RuntimeError, match="decoder"):
        cpu_ops().gguf_codes(raw.reshape(-1), wrong.kernel_type(), torch.empty(raw.size // nbytes * values,
                                                                              dtype=torch.uint8))


def _pack(parts, bits):
    """``pack_parts`` of code tensors."""
    from pagedllm.kernels import cpu_ops

    return cpu_ops().pack_parts([(p.numpy(), PLAIN_CODES, len(p), False) for p in parts], bits, parts[0].shape[1])


def test_pack_parts_equals_the_layout_of_their_concatenation():
    """``pack_parts`` of fused parts (q/k/v with row counts not a multiple of 8) is the packing of their
    concatenation padded with zero weights: byte for byte, 4- and 8-bit, in the layout of qlinear.h."""
    g = torch.Generator().manual_seed(0)
    base = {4: 0, 8: 0, 5: 112, 6: 96}  # 5 / 6: 8-bit codes (stored s + 128) with s in [-16, 16) / [-32, 32)
    for bits, pad in ((4, 0), (8, 128), (5, 128), (6, 128)):
        parts = [torch.randint(0, 2 ** bits, (n, 64), generator=g, dtype=torch.uint8) + base[bits]
                 for n in (13, 6, 8)]
        whole = torch.cat(parts + [torch.full((5, 64), pad, dtype=torch.uint8)])  # 27 rows -> 32
        packed = _pack([whole], bits)
        assert torch.equal(_pack(parts, bits), packed)
        for row, blk in ((10, 1), (3, 0), (31, 1)):  # group row // 8, block of 32 inputs, unit i, byte t
            dst = packed[row // 8, blk * bits * 32:(blk + 1) * bits * 32]
            src = whole[row, blk * 32:(blk + 1) * 32]
            for i in range(4 if bits == 4 else 8):
                for t in range(4):
                    at = 4 * (row % 8) + t
                    if bits in (5, 6):  # u: low 4 bits as the 4-bit layout's, high bits in the planes after them
                        high = ((int(dst[128 + at]) >> i & 1) if bits == 5 else
                                (int(dst[128 + 32 * (i // 4) + at]) >> 2 * (i % 4) & 3))
                        got = (int(dst[32 * (i % 4) + at]) >> 4 * (i // 4)) & 0xF | high << 4
                        want = int(src[4 * i + t]) - base[bits]
                    else:
                        got = int(dst[32 * i + at])
                        want = (int(src[4 * i + t]) | int(src[16 + 4 * i + t]) << 4) if bits == 4 else (
                            int(src[4 * i + t]) ^ 0x80)
                    assert got == want
    for bits, bad in ((5, 144), (5, 111), (6, 160), (6, 95)):  # s = 16, -17 do not fit 5 bits; 32, -33 not 6
        with pytest.raises(RuntimeError, match="outside"):
            _pack([torch.full((8, 64), bad, dtype=torch.uint8)], bits)


@pytest.mark.parametrize("kind", sorted(FAST_CODES))
def test_packing_raw_blocks_equals_packing_their_decoded_codes(kind):
    """The block kernel packs a GGUF tensor's codes straight from its blocks (``RawCodes``: what a start-up runs,
    no array of a byte per weight): the same bytes as packing the decoded codes, alone, fused with a part of codes,
    and widened (4-bit codes in an 8-bit layer: + 128); ``row_slice`` of deferred codes slices the blocks."""
    from pagedllm.kernels import cpu_ops
    from pagedllm.quant.formats import row_slice
    from pagedllm.quant.gguf_blocks import RawCodes

    ops = cpu_ops()
    raw = random_blocks(kind, 21, 512, seed=5)
    rc = RawCodes(raw, kind)
    codes = decode(raw, kind).codes
    assert torch.equal(rc.tensor(), codes)
    bits = 4 if decode(raw, kind).bits == 4 else 8
    other = torch.randint(0, 2 ** bits, (11, 512), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    assert torch.equal(ops.pack_parts([rc.source()], bits, 512), _pack([codes], bits))
    assert torch.equal(ops.pack_parts([(other.numpy(), PLAIN_CODES, 11, False), rc.source()], bits, 512),
                       _pack([other, codes], bits))
    if bits == 4:
        assert torch.equal(rc.widened().tensor(), codes + 128)
        assert torch.equal(ops.pack_parts([rc.widened().source()], 8, 512), _pack([codes + 128], 8))
    deferred = decode(raw, kind, defer=True)
    assert deferred.codes.is_meta and deferred.code_parts[0].shape == (21, 512)
    assert torch.equal(deferred.materialized().codes, codes)
    assert torch.equal(row_slice(deferred, 5).materialized().codes, codes[:5])
    assert torch.equal(dequantize(deferred), dequantize(decode(raw, kind)))
    with pytest.raises(RuntimeError, match="a part of 21 rows has"):  # bytes that are not the rows they claim
        ops.pack_parts([(raw[:20], BLOCK_TYPES[kind].kernel_type(), 21, False)], bits, 512)
    with pytest.raises(RuntimeError, match="must be widened"):  # codes of the other width than the layout's
        ops.pack_parts([rc.source()], 12 - bits, 512)


def _resident_kib(path) -> int:
    """This process's resident KiB of its mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head[0]):  # a mapping's first line: range perms offset dev inode [path]
            inside = len(head) >= 6 and head[5] == str(path)
        elif inside and head[0] == "Rss:":
            total += int(head[1])
    return total


def _mapped(tmp_path, raw: np.ndarray):
    """``raw`` written to a file and mapped read-only, as a GGUF file's tensors are: (path, map, its array)."""
    import mmap

    path = tmp_path / "blocks.bin"
    path.write_bytes(raw.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return path, mm, np.frombuffer(mm, dtype=np.uint8).reshape(raw.shape)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps; the drop is Linux's madvise")
def test_packing_drops_a_files_pages_as_it_passes_them(tmp_path):
    """A start's peak memory: a GGUF tensor's blocks are pages of the file's mapping, and packing them (``drop``, the
    5th item of a part, set by ``RawCodes`` with a ``release``) drops each run of passed pages from the resident
    set, so a large tensor's file pages are not resident beside its packed copy (the 1.5B's head: its start's peak
    ~200 MB lower); the packed bytes are the same. Without drop, the passed pages stay resident. A deferred decode
    (what the loader runs) releases the pages its scales touched before the packing reads them again."""
    import mmap

    from pagedllm.kernels import cpu_ops
    from pagedllm.quant.gguf_blocks import RawCodes

    ops = cpu_ops()
    kind, rows, k = "Q6_K", 16384, 512  # 3.4 MB of blocks: 16 runs of 1024 groups of 8 rows
    raw = random_blocks(kind, rows, k, seed=9)
    path, mm, blocks = _mapped(tmp_path, raw)
    want = ops.pack_parts([RawCodes(raw, kind).source()], 8, k)  # from the process's own memory (never dropped)
    kept = ops.pack_parts([RawCodes(blocks, kind).source()], 8, k)
    assert torch.equal(kept, want) and _resident_kib(path) > 0.9 * raw.nbytes / 1024
    mm.madvise(mmap.MADV_DONTNEED)
    released = []
    rc = RawCodes(blocks, kind, release=lambda lo=0, hi=None: released.append(mm.madvise(mmap.MADV_DONTNEED)))
    assert rc.source()[4] is True and RawCodes(raw, kind).source()[4] is False
    assert torch.equal(ops.pack_parts([rc.source()], 8, k), want)
    assert _resident_kib(path) < 0.1 * raw.nbytes / 1024  # the boundary pages of each run at most
    assert not released  # the packing dropped them itself
    decode(blocks, kind)  # touches every page
    assert _resident_kib(path) > 0.9 * raw.nbytes / 1024
    deferred = decode(blocks, kind, defer=True, release=rc.release)
    assert released and _resident_kib(path) == 0
    assert torch.equal(ops.pack_parts([deferred.code_parts[0].source()], 8, k), want)
    del blocks, deferred, rc
    mm.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps; the drop is Linux's madvise")
@pytest.mark.parametrize("kind,defer", [("Q6_K", True), ("Q3_K", False)])
def test_decoding_drops_each_chunks_file_pages_as_it_goes(tmp_path, kind, defer):
    """A tensor decoded in chunks of rows (its scales with its codes deferred, as the loader decodes the kernels'
    types; or codes and scales of a type the Python decoders read) releases each chunk's file pages once that chunk
    is decoded (``release(lo, hi)``: the chunk's bytes), so at most about one chunk of the file is resident at a
    time: a large head's blocks (the 1.5B's 191 MB) are no longer all resident at the start's peak. Released once at
    the end instead, every page of the tensor would be resident by then."""
    from pagedllm.gguf_file import GGUFFile
    from pagedllm.quant.gguf_blocks import CHUNK_ROWS

    rows, k = 3 * CHUNK_ROWS, 2048  # Q6_K: 1680 bytes a row, three chunks of 13.8 MB (Q3_K: 880, 7.2 MB)
    raw = random_blocks(kind, rows, k, seed=11)
    path, mm, blocks = _mapped(tmp_path, raw)
    tensor = type("T", (), {"data_offset": 0, "n_bytes": raw.nbytes})()
    reader = GGUFFile.__new__(GGUFFile)  # only its page release, over this map
    reader._map = mm
    calls = []

    def release(lo=0, hi=None):
        calls.append((lo, hi, _resident_kib(path)))
        reader.release(tensor, lo, hi)

    qw = decode(blocks, kind, defer=defer, release=release)
    chunk_kib = CHUNK_ROWS * raw.shape[1] / 1024
    ranges = [(lo, hi) for lo, hi, _ in calls if hi is not None]
    assert ranges == [(r * raw.shape[1], (r + CHUNK_ROWS) * raw.shape[1]) for r in range(0, rows, CHUNK_ROWS)]
    # one chunk, and the pages its edges share with its neighbours (a file's page cache may map in 2 MiB folios)
    assert max(kib for _, _, kib in calls) < chunk_kib + 4096 + 512
    want = decode(raw, kind)
    assert torch.equal(qw.scales, want.scales)
    if not defer:
        assert torch.equal(qw.codes, want.codes)
    del blocks, qw
    mm.close()


def test_fused_deferred_weight_packs_as_the_concatenated_one():
    """A GGUF layer fused from a Q4_K and a Q6_K part (the 1.5B's q/k/v in half its layers) with deferred codes
    builds the same block linear (packed codes, scales) as from the decoded, concatenated weight."""
    from pagedllm.kernels import cpu_ops
    from pagedllm.quant.linear import BlockQuantLinear

    ops = cpu_ops()
    a, b = random_blocks("Q4_K", 24, 512, seed=7), random_blocks("Q6_K", 16, 512, seed=8)
    eager = concat([decode(a, "Q4_K"), decode(b, "Q6_K")])
    lazy = concat([decode(a, "Q4_K", defer=True), decode(b, "Q6_K", defer=True)], defer_codes=True)
    assert lazy.codes.is_meta and len(lazy.code_parts) == 2 and lazy.bits == eager.bits == 8
    assert torch.equal(lazy.materialized().codes, eager.codes)
    x, y = (BlockQuantLinear(w, None, torch.device("cpu"), torch.float32, ops) for w in (eager, lazy))
    for name in ("codes", "scales", "offsets", "super_scales", "super_offsets"):
        u, v = getattr(x, name), getattr(y, name)
        assert (u is None and v is None) or torch.equal(u, v), name
    inp = torch.randn(3, 512)
    assert torch.equal(x(inp), y(inp))


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_block_kernel_matches_float_matmul_of_the_decoded_values(kind):
    from pagedllm.kernels import cpu_ops
    from pagedllm.layers.linear import tensor_bytes
    from pagedllm.quant.linear import BlockQuantLinear

    ops = cpu_ops()
    assert ops is not None
    n, k = 44, 768  # a partial group of 8 rows; 3 super-blocks
    raw = random_blocks(kind, n, k, seed=1)
    qw = decode(raw, kind)
    w = reference(raw, kind)
    lin = BlockQuantLinear(qw, None, torch.device("cpu"), torch.float32, ops)
    assert k_scaled(qw) == (kind in K_SCALED) == (qw.kscales is not None)  # the table the runtime plan reads
    assert torch.equal(lin.dequantized(), w)  # the packed layout decodes back to the file's numbers
    assert torch.equal(lin.embedding(torch.tensor([[0, 7, 43]])), w[[0, 7, 43]].unsqueeze(0))
    flat = None  # K-quants: the same weight with float32 scales per block instead of the file's two-level ones
    if qw.kscales is not None:
        assert lin.super_scales is not None and lin.scales.dtype == torch.int8  # 1 byte per sub-block and row
        flat = BlockQuantLinear(dataclasses.replace(qw, kscales=None), None, torch.device("cpu"), torch.float32, ops)
        assert flat.super_scales is None and tensor_bytes(lin.tensors()) < tensor_bytes(flat.tensors())
    torch.manual_seed(0)
    for m in (1, 2, 3, 5, 17, 64):  # single rows, a row tile and its remainders, several row chunks
        x = torch.randn(m, k)
        y = lin(x)
        if flat is not None:
            assert torch.equal(y, flat(x))  # D * s is exact in float32: bitwise the same results
        ref = x.double() @ w.double().T
        # two int8 levels per activation keep ~15 bits: the error is ~1e-4 of the row's |x| |w|
        scale = x.abs().double() @ w.abs().double().T
        assert ((y.double() - ref).abs() <= 2e-4 * scale + 1e-6).all(), (kind, m)
        assert torch.equal(lin(x[:1]), y[:1])  # a row's result does not depend on its batch


NARROW = {t.name: t.narrow for t in BLOCK_TYPES.values() if t.narrow < 8}


@pytest.mark.parametrize("kind,bits", sorted(NARROW.items()) + [("Q4_0+Q5_0", 5), ("Q4_K+Q6_K", 6), ("codes", 5)])
def test_5_and_6_bit_layouts_run_as_the_8_bit_one_bit_for_bit(kind, bits, monkeypatch):
    """8-bit codes that all lie in [-16, 16) (GGUF Q5_0, as Qwen2.5-Coder 0.5B's and Gemma 3's Q4_K_M files hold most
    of their layers; a fused layer of Q5_0 with 4-bit parts widened; codes from a tensor) are packed in 5 bits, 5/8
    of the 8-bit layout's code bytes; those in [-32, 32) (Q6_K, Q5_K; a Q4_K_M file's fused q/k/v with a Q6_K v) in
    6 bits, 3/4. Every path (one row, the row tiles and their remainders, the many-row tiles on weights decoded a
    slice of blocks at a time, AMX, 8-bit activations, bfloat16 inputs,
    the bfloat16 decode of the stripes, embedding rows) gives bitwise the 8-bit layout's results, on every
    instruction-set level (the layouts are the default where the kernels have 512-bit VNNI). Codes that fit
    neither (Q8_0's) keep 8 bits."""
    import pagedllm.quant.linear as ql
    from pagedllm.kernels import cpu_ops

    assert ql._narrow_kernels(cpu_ops()) == ("+vnni" in cpu_ops().isa())
    monkeypatch.setattr(ql, "_narrow_kernels", lambda ops: True)

    # (Q5_0 codes: 25 blocks a row, so the many-row tiles' slices of decoded blocks end in a partial one)
    n, k = 44, 800 if kind == "codes" else 768
    if "+" in kind:
        a, b = kind.split("+")
        qw = concat([decode(random_blocks(a, 28, k, seed=9), a, defer=True),
                     decode(random_blocks(b, 16, k, seed=10), b, defer=True)], defer_codes=True)
    elif kind == "codes":
        qw = decode(random_blocks("Q5_0", n, k, seed=11), "Q5_0").materialized()
    else:
        qw = decode(random_blocks(kind, n, k, seed=6), kind, defer=kind in FAST_CODES)
    five = ql.BlockQuantLinear(qw, None, torch.device("cpu"), torch.float32, cpu_ops())
    monkeypatch.setattr(ql, "_narrow_bits", lambda part: 8)
    eight = ql.BlockQuantLinear(qw, None, torch.device("cpu"), torch.float32, cpu_ops())
    assert (five.layout_bits, eight.layout_bits) == (bits, 8)
    assert 8 * five.codes.numel() == bits * eight.codes.numel()
    assert torch.equal(five.dequantized(), eight.dequantized())
    assert torch.equal(five.embedding(torch.tensor([0, 9, 43])), eight.embedding(torch.tensor([0, 9, 43])))
    assert torch.equal(five.weight_bf16(1, 6), eight.weight_bf16(1, 6))
    ops = cpu_ops()
    torch.manual_seed(3)
    try:
        for amx in (True, False):  # AMX's tiles from 6 rows where the CPU has them, then the VNNI / AVX2 tiles
            ops.set_qlinear_amx(amx)
            for levels in (2, 1):
                five.act_levels = eight.act_levels = levels
                for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 40, 100):
                    x = torch.randn(m, k)
                    assert torch.equal(five(x), eight(x)), (kind, amx, levels, m)
                x = torch.randn(5, k, dtype=torch.bfloat16)
                assert torch.equal(five(x), eight(x)), (kind, amx, levels, "bf16")
    finally:
        ops.set_qlinear_amx(True)
    if ops.bf16_tiles():  # AMX-BF16: the bfloat16 tiles decode the 5-bit codes as the 8-bit ones
        five.bf16_tile_min_rows = eight.bf16_tile_min_rows = 1
        x = torch.randn(20, k)
        assert torch.equal(five(x), eight(x))
    monkeypatch.undo()
    q8 = ql.BlockQuantLinear(decode(random_blocks("Q8_0", 8, 64), "Q8_0"), None, torch.device("cpu"),
                             torch.float32, cpu_ops())
    assert q8.layout_bits == 8


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_amx_tiles_equal_the_vnni_tiles_bit_for_bit(kind, levels):
    """Where the build has AMX and the OS grants its tile state (Sapphire Rapids and later Xeons), qlinear's steps of
    8+ rows run on the tile unit (under 16 rows: one shorter tile): the same integer sums and float steps as the
    AVX-512 VNNI tiles, so each result is bitwise the VNNI one (row tails past a 16-row tile, a partial pair of
    groups, bfloat16 activations included).
    Elsewhere ``set_qlinear_amx`` reports AMX off and both runs are the VNNI (or AVX2) tiles."""
    from pagedllm.kernels import cpu_info, cpu_ops
    from pagedllm.quant.linear import BlockQuantLinear

    ops = cpu_ops()
    n, k = 44, 768  # 6 groups of 8 rows (the last partial): a run of 4 groups, then a run of 2
    lin = BlockQuantLinear(decode(random_blocks(kind, n, k, seed=2), kind), None, torch.device("cpu"), torch.float32,
                           ops)
    lin.act_levels = levels  # 1: 8-bit activations, their fine-level tiles skipped
    try:
        on = ops.set_qlinear_amx(True)
        assert on == ("+amx" in ops.isa())
        assert not on or {"amx_tile", "amx_int8"} <= cpu_info()[1]  # never on a CPU without the tiles
        torch.manual_seed(0)
        for m, dtype in ((6, torch.float32), (7, torch.float32), (8, torch.float32), (13, torch.float32), (16, torch.float32), (17, torch.float32),
                         (40, torch.float32), (100, torch.float32), (33, torch.bfloat16)):
            x = torch.randn(m, k, dtype=dtype)
            ops.set_qlinear_amx(True)
            y = lin(x)
            assert not ops.set_qlinear_amx(False) and "+amx" not in ops.isa()
            assert torch.equal(lin(x), y), (kind, m, dtype)
    finally:
        ops.set_qlinear_amx(True)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q5_0", "Q6_K", "Q8_0", "Q3_K"])
def test_8_bit_activations_are_the_coarse_level_alone(kind):
    """``act_levels`` 1 (``--activation-bits 8``): each block of 32 activations as round(x * 127 / max|x|), one int8
    per input (llama.cpp's Q8_0 rows). The result is the float matmul of those values (to float rounding), every row
    the same alone and batched, and further from the exact product than the two-level default."""
    from pagedllm.kernels import cpu_ops
    from pagedllm.quant.linear import BlockQuantLinear

    n, k = 44, 768
    raw = random_blocks(kind, n, k, seed=4)
    w = reference(raw, kind).double()
    lin = BlockQuantLinear(decode(raw, kind), None, torch.device("cpu"), torch.float32, cpu_ops())
    torch.manual_seed(1)
    for m in (1, 3, 4, 5, 8, 9, 17, 40):  # 4-row tiles with one level (qlinear.h ZMT_ONE), their remainders
        x = torch.randn(m, k)
        two = lin(x)
        lin.act_levels = 1
        one = lin(x)
        lin.act_levels = 2
        blocks = x.numpy().reshape(m, -1, 32)
        amax = np.abs(blocks).max(-1, keepdims=True)
        q = np.rint(blocks * (np.float32(127) / amax))  # the kernel's float32 steps, rounded to nearest even
        x8 = torch.from_numpy(q.astype(np.float64) * (amax.astype(np.float64) / 127)).reshape(m, k)
        scale = x.abs().double() @ w.abs().T
        assert ((one.double() - x8 @ w.T).abs() <= 1e-5 * scale + 1e-6).all(), (kind, m)
        exact = x.double() @ w.T
        assert (one.double() - exact).abs().mean() > 5 * (two.double() - exact).abs().mean()
        lin.act_levels = 1
        for i in range(m):  # every row as alone: the tiles' arithmetic does not depend on the batch
            assert torch.equal(lin(x[i:i + 1]), one[i:i + 1]), (kind, m, i)
        lin.act_levels = 2


def test_mixed_types_fuse_exactly():
    """q/k as Q4_K and v as Q6_K (a Q4_K_M file's layer) fuse into one weight with the same numbers."""
    parts = [("Q4_K", 64), ("Q5_0", 32), ("Q6_K", 32)]
    raws = [random_blocks(kind, rows, 256, seed=i) for i, (kind, rows) in enumerate(parts)]
    fused = concat([decode(r, kind) for r, (kind, _) in zip(raws, parts)])
    assert fused.bits == 8 and fused.group_size == 16
    assert torch.equal(dequantize(fused), torch.cat([reference(r, kind) for r, (kind, _) in zip(raws, parts)]))


def test_mxfp4_fuses_exactly():
    """MXFP4's table codes fused with MXFP4 (gate and up: the table kept, 4-bit) or with another type (widened to
    8-bit codes of the table's values): the same numbers as the parts."""
    for parts, bits in (([("MXFP4", 32), ("MXFP4", 16)], 4), ([("MXFP4", 32), ("Q8_0", 16)], 8),
                        ([("Q4_0", 16), ("MXFP4", 32)], 8)):
        raws = [random_blocks(kind, rows, 64, seed=i) for i, (kind, rows) in enumerate(parts)]
        fused = concat([decode(r, kind) for r, (kind, _) in zip(raws, parts)])
        assert fused.bits == bits and (fused.table is not None) == (bits == 4)
        assert torch.equal(dequantize(fused), torch.cat([reference(r, kind) for r, (kind, _) in zip(raws, parts)]))


# ------------------------------------------------------------------ one tensor of each type through the engine
# layer 0 and 1's linears and the (tied) embedding, each in another block type (hidden 256: a K-quant super-block)
TINY_TYPES = {
    "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q2_K", "blk.0.attn_v.weight": "Q6_K",
    "blk.0.attn_output.weight": "Q3_K", "blk.0.ffn_gate.weight": "Q5_K", "blk.0.ffn_up.weight": "IQ4_XS",
    "blk.0.ffn_down.weight": "Q5_0",
    "blk.1.attn_q.weight": "Q4_0", "blk.1.attn_k.weight": "Q4_1", "blk.1.attn_v.weight": "Q5_1",
    "blk.1.attn_output.weight": "Q8_0", "blk.1.ffn_gate.weight": "IQ4_NL", "blk.1.ffn_up.weight": "Q6_K",
    "blk.1.ffn_down.weight": "MXFP4",
    "token_embd.weight": "Q6_K",
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 2-layer llama GGUF (the default model's tokenizer) with every linear in another block type, written with
    the ``gguf`` writer; random codes, scales sized so each weight's values are ~N(0, 1/K)."""
    return _tiny_gguf(str(tmp_path_factory.mktemp("tiny") / "tiny-every-block-type.gguf"), TINY_TYPES)


def _tiny_gguf(path: str, types: dict[str, str]) -> str:
    from pagedllm.config import default_model_path
    from pagedllm.gguf_file import GGUFFile

    src = GGUFFile(default_model_path())
    hidden, ffn, heads, kv_heads, vocab = 256, 512, 4, 2, len(src.get("tokenizer.ggml.tokens"))
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * 64, hidden), "attn_v": (kv_heads * 64, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(src.get("tokenizer.ggml.model"))
    w.add_tokenizer_pre(src.get("tokenizer.ggml.pre"))
    w.add_token_list(src.get("tokenizer.ggml.tokens"))
    w.add_token_types(src.get("tokenizer.ggml.token_type"))
    w.add_token_merges(src.get("tokenizer.ggml.merges"))
    w.add_bos_token_id(src.get("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(src.get("tokenizer.ggml.eos_token_id"))
    w.add_chat_template(src.get("tokenizer.chat_template"))
    rng = np.random.default_rng(7)
    for name, kind in types.items():
        rows, k = (vocab, hidden) if name in ("token_embd.weight", "output.weight") else shapes[name.split(".")[2]]
        raw = random_blocks(kind, rows, k, seed=len(name))
        # rescale the float16 super-block scales so the values are ~N(0, 1/k) whatever the type's code range
        vals = reference(raw, kind)
        f = (1.0 / np.sqrt(k)) / float(vals.std())
        for off in F16_FIELDS[kind]:
            block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
            b = raw.reshape(-1, block)
            b[:, off:off + 2] = (b[:, off:off + 2].copy().view(np.float16) * f).astype(np.float16).view(np.uint8)
        if kind in E8M0_FIELDS:  # a power-of-two scale: its exponent moved by log2(f)
            b = raw.reshape(-1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1])
            b[:, E8M0_FIELDS[kind]] = (b[:, E8M0_FIELDS[kind]].astype(int) + round(np.log2(f))).astype(np.uint8)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])  # shape from the bytes
    for i in range(2):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_block_type_through_the_engine(tiny_gguf, monkeypatch):
    """The default path keeps every tensor in its block type (no float32 copy) and its greedy tokens follow the
    float32 path's (gguf's own de-quantization, torch GEMMs): logprobs within 0.05, near-ties aside; a request's
    tokens are the same alone and batched. The weight plan is pinned to the packed blocks: on layers this small
    (0.06 ms a call) whether a float32 copy wins by the plan's margin is the timer's coin toss, which
    ``tests/worker/test_autotune.py`` covers."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.worker import plan as runtime_plan
    from pagedllm.worker.autotune import WeightPlan

    monkeypatch.setattr(runtime_plan, "choose_plan", lambda *a, **k: WeightPlan(True, 0, 0, "float32", "measured", {}))

    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,"]
    ref = LLM(model=tiny_gguf, dtype="float32", enable_prefix_caching=False).generate(prompts, sp, use_tqdm=False)
    auto = LLM(model=tiny_gguf, enable_prefix_caching=False, kv_cache_dtype="float32")
    rt = auto.engine.runtime
    assert rt["weights"] == "gguf blocks (auto)", rt
    lins = model_of(auto).linears()
    assert {lin.kind for lin in lins.values()} <= {"q4-block", "q8-block"}
    assert any(getattr(lin, "sub", 1) == 2 for lin in lins.values())  # blocks of 16 (Q2_K, Q3_K, Q6_K)
    got = auto.generate(prompts, sp, use_tqdm=False)
    agree = 0
    for g, r in zip(got, ref):
        for i, (a, b) in enumerate(zip(g.outputs[0].token_ids, r.outputs[0].token_ids)):
            assert abs(g.outputs[0].logprobs[i].logprob - r.outputs[0].logprobs[i].logprob) < 0.05
            if a != b:
                break
            agree += 1
    assert agree >= len(prompts) * 12 // 2, agree
    alone = [auto.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert alone == [g.outputs[0].token_ids for g in got]


@pytest.mark.parametrize("embed_kind", ["Q4_K", "Q5_0"])
def test_an_untied_embedding_is_looked_up_in_the_files_blocks(tmp_path, monkeypatch, embed_kind):
    """A GGUF file with its own ``output`` head (Qwen2.5-Coder's, both sizes): ``token_embd`` is only looked up, so
    its blocks stay in the file's memory map (``BlockRows``: no packed copy, the rows decoded per step; the 1.5B's
    start 117 MiB lighter). Its rows are bitwise the packed table's (every block type), and the engine's greedy
    tokens and logprobs are exactly those of the same file with the table packed."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.layers.weights import WeightSource
    from pagedllm.quant.gguf_blocks import BlockRows
    from pagedllm.worker import plan as runtime_plan
    from pagedllm.worker.autotune import WeightPlan

    monkeypatch.setattr(runtime_plan, "choose_plan", lambda *a, **k: WeightPlan(True, 0, 0, "float32", "measured", {}))
    path = _tiny_gguf(str(tmp_path / "untied.gguf"), {**TINY_TYPES, "token_embd.weight": embed_kind,
                                                      "output.weight": "Q6_K"})
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,"]
    rows = LLM(model=path, enable_prefix_caching=False, kv_cache_dtype="float32")
    table = model_of(rows).embed
    assert isinstance(table, BlockRows) and table.kind == "gguf-rows" and table.tensors() == []
    got = rows.generate(prompts, sp, use_tqdm=False)
    monkeypatch.setattr(WeightSource, "lookup_table", lambda self, name: self.linear(name, [name], "embed"))
    packed = LLM(model=path, enable_prefix_caching=False, kv_cache_dtype="float32")
    assert model_of(packed).embed.kind == ("q4-block" if embed_kind == "Q4_K" else "q8-block")
    assert model_of(packed).weight_bytes() - model_of(rows).weight_bytes() >= table.out_features * table.in_features // 2
    ids = torch.tensor([[0, 5, table.out_features - 1], [7, 7, 1]])
    assert torch.equal(table.embedding(ids), model_of(packed).embed.embedding(ids))
    want = packed.generate(prompts, sp, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [lp.logprob for lp in g.outputs[0].logprobs] == [lp.logprob for lp in w.outputs[0].logprobs]


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_block_rows_equal_the_packed_tables_rows(kind):
    """``BlockRows`` (a table looked up in the file's blocks) gives the packed table's rows bit for bit, any shape of
    ids, in every block type."""
    from pagedllm.kernels import cpu_ops
    from pagedllm.quant.gguf_blocks import BlockRows, LazyBlocks
    from pagedllm.quant.linear import BlockQuantLinear

    raw = random_blocks(kind, 44, 768, seed=3)
    table = BlockRows(LazyBlocks(raw, kind, (44, 768)), torch.float32)
    packed = BlockQuantLinear(decode(raw, kind), None, torch.device("cpu"), torch.float32, cpu_ops())
    for ids in (torch.tensor([3]), torch.tensor([[0, 7, 43], [5, 5, 1]]), torch.arange(44)):
        assert torch.equal(table.embedding(ids), packed.embedding(ids)), (kind, ids.shape)


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_bf16_stripes_decode_the_file_values_and_multiply_them(kind, monkeypatch):
    """``qweight_bf16``: any range of groups of 8 rows (the last one partial) decodes to the file's numbers rounded
    to bfloat16, bit for bit; a step of ``bf16_min_tokens`` rows or more runs x W^T on those stripes (bf16
    activations, float32 sums), a smaller one on the block kernels."""
    from pagedllm.kernels import cpu_ops
    from pagedllm.quant import linear as qlinear
    from pagedllm.quant.linear import BlockQuantLinear

    ops = cpu_ops()
    n, k = 44, 768
    raw = random_blocks(kind, n, k, seed=2)
    qw = decode(raw, kind)
    w = reference(raw, kind)
    lins = [BlockQuantLinear(qw, None, torch.device("cpu"), torch.float32, ops)]
    if qw.kscales is not None:  # the file's two-level scales and the float32 ones: the same numbers
        lins.append(BlockQuantLinear(dataclasses.replace(qw, kscales=None), None, torch.device("cpu"), torch.float32,
                                     ops))
    for lin in lins:
        assert torch.equal(lin.weight_bf16(0, 6), w.bfloat16())
        assert torch.equal(lin.weight_bf16(2, 4), w[16:32].bfloat16())
        assert torch.equal(lin.weight_bf16(5, 6), w[40:].bfloat16())
    with pytest.raises(RuntimeError, match="outside"):
        lins[0].weight_bf16(3, 7)
    lin = lins[0]
    monkeypatch.setattr(qlinear, "STRIPE_ROWS", 16)  # several stripes, the last one partial
    decoded = []
    monkeypatch.setattr(lin, "weight_bf16", lambda g0, g1: decoded.append((g0, g1)) or BlockQuantLinear.weight_bf16(
        lin, g0, g1))
    lin.bf16_min_tokens = 40
    torch.manual_seed(0)
    x = torch.randn(40, k)
    y = lin(x)
    assert decoded == [(0, 2), (2, 4), (4, 6)]
    ref = x.bfloat16().double() @ w.bfloat16().double().T
    scale = x.abs().double() @ w.abs().double().T
    assert ((y.double() - ref).abs() <= 4e-3 * scale + 1e-6).all()  # the bf16 output's rounding, 2^-9
    decoded.clear()
    small = lin(x[:39])
    assert not decoded  # the block kernels
    exact = x[:39].double() @ w.double().T
    assert ((small.double() - exact).abs() <= 2e-4 * scale[:39] + 1e-6).all()  # the block kernels' precision


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_bf16_tiles_multiply_the_decoded_values(kind):
    """``qlinear`` levels 0 (``bf16_tile_min_rows``, AMX-BF16): the weights decoded to bfloat16 inside the kernel
    (the values ``qweight_bf16`` gives) times the bfloat16-rounded activations, summed in float32: x W^T to float32
    rounding for any rows (tails of a 16-row tile, a partial chunk of groups and a partial group, bfloat16
    activations). A row's result does not depend on the other rows of its step; below the threshold the block
    kernels run. Off where the build lacks AMX-BF16 or the OS did not grant the tiles."""
    from pagedllm.kernels import cpu_info, cpu_ops
    from pagedllm.quant.linear import BlockQuantLinear

    ops = cpu_ops()
    n, k = 44, 768
    raw = random_blocks(kind, n, k, seed=2)
    w = reference(raw, kind)
    lin = BlockQuantLinear(decode(raw, kind), None, torch.device("cpu"), torch.float32, ops)
    assert not ops.bf16_tiles() or {"amx_bf16", "amx_tile"} <= cpu_info()[1]
    if not ops.bf16_tiles():
        with pytest.raises(RuntimeError, match="AMX-BF16"):
            ops.qlinear(torch.zeros(16, 64), torch.zeros(1, 256, dtype=torch.uint8), torch.zeros(1, 16),
                        torch.zeros(1, 16), 4, 8, 0)
        pytest.skip("this CPU or build has no AMX-BF16 tiles (checked: qlinear refuses levels 0)")
    lin.bf16_tile_min_rows = 16
    torch.manual_seed(0)
    wb = w.bfloat16().double()
    for m, dtype in ((16, torch.float32), (17, torch.float32), (32, torch.float32), (40, torch.float32),
                     (100, torch.float32), (33, torch.bfloat16)):
        x = torch.randn(m, k, dtype=dtype)
        y = lin(x)
        ref = x.bfloat16().double() @ wb.T
        scale = x.abs().double() @ w.abs().double().T
        tol = 4e-3 if dtype == torch.bfloat16 else 1e-5  # bf16 output rounding, else float32 sums
        assert ((y.double() - ref).abs() <= tol * scale + 1e-6).all(), (kind, m, dtype)
        assert torch.equal(lin(x[:16]), y[:16]), (kind, m)  # rows independent of the step's other rows
    x = torch.randn(15, k)
    exact = x.double() @ w.double().T
    scale = x.abs().double() @ w.abs().double().T
    assert ((lin(x).double() - exact).abs() <= 2e-4 * scale + 1e-6).all()  # under 16 rows: the block kernels


def test_bf16_stripes_of_a_gated_mlp():
    """``BlockQuantLinear.gated``: down(act(gate) * up) of a fused gate/up projection on bfloat16 stripes (gate and
    up rows decoded together, the product kept in bf16) matches the float64 product of the file's numbers at bf16
    precision; below ``bf16_min_tokens`` rows, or for a down projection that has no stripes, it declines (None)."""
    from pagedllm.kernels import cpu_ops
    from pagedllm.quant.linear import BlockQuantLinear

    ops = cpu_ops()
    inter, hidden = 288, 256  # 288 intermediate columns: a whole stripe of 256 and a part
    up_raw, down_raw = random_blocks("Q4_K", 2 * inter, hidden, seed=3), random_blocks("Q8_0", hidden, inter, seed=4)
    gate_up = BlockQuantLinear(decode(up_raw, "Q4_K"), None, torch.device("cpu"), torch.float32, ops)
    down = BlockQuantLinear(decode(down_raw, "Q8_0"), None, torch.device("cpu"), torch.float32, ops)
    wg, wd = reference(up_raw, "Q4_K").double(), reference(down_raw, "Q8_0").double()
    torch.manual_seed(0)
    x = torch.randn(20, hidden)
    assert gate_up.gated(x, ops.silu_and_mul, down) is None  # no stripes asked for
    gate_up.bf16_min_tokens = down.bf16_min_tokens = 20
    assert gate_up.gated(x[:19], ops.silu_and_mul, down) is None  # too few rows
    y = gate_up.gated(x, ops.silu_and_mul, down)
    g, u = (x.double() @ wg.T).chunk(2, dim=-1)
    h = torch.nn.functional.silu(g) * u
    ref = h @ wd.T
    scale = h.abs() @ wd.abs().T
    assert y.dtype == torch.float32 and ((y.double() - ref).abs() <= 2e-2 * scale + 1e-6).all()
    down.bf16_min_tokens = 0
    assert gate_up.gated(x, ops.silu_and_mul, down) is None


def test_bf16_tiles_through_the_engine(tiny_gguf, monkeypatch):
    """With bf16 large steps and a kernel build with AMX-BF16 tiles, the layers' linears run steps from
    ``BF16_TILE_MIN_ROWS`` rows (by code bits) on qlinear's bfloat16 tiles and the stripes start at
    ``BF16_TILES_STEP_MIN_TOKENS``; /health's runtime says so; a 100-token prompt's greedy tokens follow the float32
    path's (logprobs within 0.05). Without the tiles the layers keep the stripes from 256 rows and no tiles."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.kernels import cpu_ops
    from pagedllm.worker import plan as runtime_plan
    from pagedllm.worker.autotune import WeightPlan

    monkeypatch.setattr(runtime_plan, "choose_plan", lambda *a, **k: WeightPlan(True, 0, 0, "float32", "measured", {}))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompt = {"prompt_token_ids": [(i * 37) % 5000 + 10 for i in range(100)]}
    ref = LLM(model=tiny_gguf, dtype="float32", enable_prefix_caching=False).generate([prompt], sp, use_tqdm=False)
    llm = LLM(model=tiny_gguf, enable_prefix_caching=False, kv_cache_dtype="float32", large_step_weights="bf16")
    tiles = cpu_ops().bf16_tiles()
    lins = model_of(llm).linears()
    layers = {n: lin for n, lin in lins.items() if n.startswith("layers.")}
    assert getattr(lins["lm_head"], "bf16_tile_min_rows", 0) == 0  # the head's few rows keep their blocks
    for lin in layers.values():
        assert lin.bf16_tile_min_rows == (runtime_plan.BF16_TILE_MIN_ROWS[lin.bits] if tiles else 0)
        assert lin.bf16_min_tokens == (runtime_plan.BF16_TILES_STEP_MIN_TOKENS if tiles else 256)
    rt = llm.engine.runtime
    assert ("bf16_tile_min_rows" in rt) == tiles
    levels = []  # (rows, levels) of each kernel call: levels 0 are the bfloat16 tiles
    ops = cpu_ops()
    for name, at in (("qlinear", 5), ("qlinear_k", 7)):  # levels' position after x
        monkeypatch.setattr(ops, name, lambda x, *a, _f=getattr(ops, name), _at=at: levels.append((len(x), a[_at]))
                            or _f(x, *a))
    got = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert {lv for m, lv in levels if m == 100} == ({0} if tiles else {2})  # the prompt's step: tiles (or blocks)
    assert {lv for m, lv in levels if m == 1} == {2}  # decode rows: the int8 blocks
    r = ref[0].outputs[0]
    for i, (a, b) in enumerate(zip(got.token_ids, r.token_ids)):
        assert abs(got.logprobs[i].logprob - r.logprobs[i].logprob) < 0.05
        if a != b:
            break


def test_bf16_large_steps_through_the_engine(tiny_gguf, monkeypatch):
    """``--large-step-weights bf16``: the layers' linears (not the LM head) take steps of 256+ rows on bfloat16
    stripes, and a 300-token prompt's greedy tokens follow the float32 path's (logprobs within 0.05); auto takes
    them only on a CPU with AMX-BF16, unless the file's verdict (a standard gate recorded for it with the chosen
    activation bits) says they fail."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.quant.verdicts import record
    from pagedllm.worker import plan as runtime_plan
    from pagedllm.worker.autotune import WeightPlan

    monkeypatch.setattr(runtime_plan, "choose_plan", lambda *a, **k: WeightPlan(True, 0, 0, "float32", "measured", {}))
    # with AMX-BF16 tiles the stripes start later (BF16_TILES_STEP_MIN_TOKENS): the same rows here on every CPU
    monkeypatch.setattr(runtime_plan, "BF16_TILES_STEP_MIN_TOKENS", runtime_plan.BF16_STEP_MIN_TOKENS)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompt = {"prompt_token_ids": [(i * 37) % 5000 + 10 for i in range(300)]}
    ref = LLM(model=tiny_gguf, dtype="float32", enable_prefix_caching=False).generate([prompt], sp, use_tqdm=False)
    llm = LLM(model=tiny_gguf, enable_prefix_caching=False, kv_cache_dtype="float32", large_step_weights="bf16")
    assert llm.engine.runtime["large_step_weights"] == "bf16"
    lins = model_of(llm).linears()
    assert {n for n, lin in lins.items() if getattr(lin, "bf16_min_tokens", 0) == 256} == {
        n for n in lins if n.startswith("layers.")}
    from pagedllm.quant.linear import BlockQuantLinear

    decoded, gated = [], []
    decode_rows, gated_mlp = BlockQuantLinear.weight_bf16, BlockQuantLinear.gated
    monkeypatch.setattr(BlockQuantLinear, "weight_bf16", lambda self, g0, g1: decoded.append(self) or decode_rows(
        self, g0, g1))
    monkeypatch.setattr(BlockQuantLinear, "gated", lambda self, x, *a: gated.append(len(x)) or gated_mlp(self, x, *a))
    got = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    # the prompt's step took the stripes in every layer linear (the MLPs through ``gated``), the decode steps did not
    assert {id(lin) for lin in decoded} == {id(lin) for n, lin in lins.items() if n.startswith("layers.")}
    assert gated[:2] == [300, 300] and set(gated[2:]) == {1}
    r = ref[0].outputs[0]
    for i, (a, b) in enumerate(zip(got.token_ids, r.token_ids)):
        assert abs(got.logprobs[i].logprob - r.logprobs[i].logprob) < 0.05
        if a != b:
            break
    del llm
    # the quality gate's perplexity chunks are single steps that reach the stripes (so a verdict measured them)
    import inspect

    from pagedllm.eval.quality import eval_chunks
    assert inspect.signature(eval_chunks).parameters["chunk_len"].default >= runtime_plan.BF16_STEP_MIN_TOKENS
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tiny_gguf) + ".cache")
    choice = lambda: runtime_plan.large_step_weights("auto", tiny_gguf, 16)[0]  # noqa: E731
    amx = {"amx_bf16"}
    monkeypatch.setattr(runtime_plan, "cpu_info", lambda: ("cpu", amx))
    assert choice() == "bf16"  # a file without a verdict: the default
    record(tiny_gguf, 16, "bf16", False, "a looser gate", standard=False)
    assert choice() == "bf16"  # not trusted
    record(tiny_gguf, 8, "bf16", False, "the standard gate at 8 bits", standard=True)
    assert choice() == "bf16" and runtime_plan.large_step_weights("auto", tiny_gguf, 8)[0] == "blocks"
    record(tiny_gguf, 16, "bf16", False, "the standard gate", standard=True)
    assert choice() == "blocks"
    record(tiny_gguf, 16, "bf16", True, "the standard gate", standard=True)
    assert choice() == "bf16"
    assert runtime_plan.large_step_weights("blocks", tiny_gguf, 16)[0] == "blocks"
    amx.clear()  # a CPU without AMX-BF16: blocks unless asked
    assert choice() == "blocks" and runtime_plan.large_step_weights("bf16", tiny_gguf, 16)[0] == "bf16"
    # 8-bit activations for a file without a verdict: only where every layer's blocks are K-quants (this file
    # mixes in Q4_0 / Q4_1 / Q8_0 / IQ4...: 16)
    llm = LLM(model=tiny_gguf, enable_prefix_caching=False)
    assert llm.engine.runtime["activation_bits"] == 16
    assert runtime_plan.activation_bits("auto", tiny_gguf, True)[0] == 8
    assert runtime_plan.activation_bits("auto", tiny_gguf, False)[0] == 16
    record(tiny_gguf, 8, "blocks", False, "the standard gate", standard=True)
    assert runtime_plan.activation_bits("auto", tiny_gguf, True)[0] == 16  # a verdict wins over the default
    del llm
    # the plan reads K-quant-ness off the stored weights, before any model exists: all the layers' block weights
    from pagedllm.kernels import cpu_ops
    from pagedllm.model.loader import load_model_files

    cpu, ops = torch.device("cpu"), cpu_ops()
    arch, weights = load_model_files(str(tiny_gguf), native=True, lazy=True)
    assert not runtime_plan.k_quant_layers(weights, ops, cpu)
    k_only = {n: w for n, w in weights.items() if not runtime_plan.block_weights({n: w}, ops, cpu) or k_scaled(w)}
    assert len(k_only) < len(weights) and runtime_plan.k_quant_layers(k_only, ops, cpu)
    assert not runtime_plan.k_quant_layers(k_only, None, cpu)  # no block kernels: nothing runs on blocks
    assert LLM(model=tiny_gguf, enable_prefix_caching=False).engine.runtime["large_step_weights"] == "blocks"
