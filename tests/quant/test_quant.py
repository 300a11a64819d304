"""Quantization: formats, packed kernels, algorithms, GGUF native blocks, checkpoints."""

import numpy as np
import pytest
import torch

from pagedllm.layers.linear import build_linear
from pagedllm.quant.formats import (
    dequantize, dequantize_fp8, quantize_fp8, quantize_rtn, weight_error_bound)
from pagedllm.quant.linear import Fp8Linear, Int4Linear, Int8Linear


@pytest.mark.parametrize("bits,group_size,symmetric", [
    (4, 32, False), (4, 64, False), (4, 128, False), (4, 64, True), (4, 128, True), (8, 512, True), (8, 64, False),
])
def test_round_trip_within_half_a_step(bits, group_size, symmetric):
    torch.manual_seed(bits * 1000 + group_size)
    w = torch.randn(96, 512) * torch.rand(96, 1) * 3  # rows of different ranges
    w[3, 7] = 25.0  # an outlier: its group gets a coarse step, the others must not
    qw = quantize_rtn(w, bits, group_size, symmetric)
    assert qw.codes.dtype == torch.uint8 and int(qw.codes.max()) < 2 ** bits
    err = (dequantize(qw) - w).abs()
    bound = weight_error_bound(qw)
    assert (err <= bound * (1 + 1e-4) + 1e-6).all()
    # the bound is the theoretical one: a step is the group's range over the code count
    g = w.reshape(96, -1, group_size)
    step = (g.abs().amax(-1) / (2 ** (bits - 1) - 1)) if symmetric else (g.amax(-1) - g.amin(-1)) / (2 ** bits - 1)
    torch.testing.assert_close(qw.scales, step)


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="does not divide"):
        quantize_rtn(torch.randn(8, 576), 4, 128, False)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_int4_kernel_matches_dequantize_then_matmul(m, symmetric):
    torch.manual_seed(m)
    w, x, b = torch.randn(192, 256), torch.randn(m, 256), torch.randn(192)
    qw = quantize_rtn(w, 4, 64, symmetric)
    qw.input_scale = torch.rand(256) + 0.5  # AWQ-style input scaling goes through the kernel path too
    lin = build_linear(qw, b, torch.device("cpu"), torch.float32)
    assert isinstance(lin, Int4Linear)
    ref = x @ dequantize(qw).T + b
    out = lin(x)
    assert out.dtype == torch.float32
    # bf16 activations: ~3 significant digits on sums of 256 terms
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 2e-2


@pytest.mark.parametrize("m", [1, 7, 32])
def test_int8_kernel_matches_dequantize_then_matmul(m):
    torch.manual_seed(m)
    w, x = torch.randn(160, 384), torch.randn(m, 384)
    qw = quantize_rtn(w, 8, 384, True)
    lin = build_linear(qw, None, torch.device("cpu"), torch.float32)
    assert isinstance(lin, Int8Linear)
    ref = x @ dequantize(qw).T
    assert ((lin(x) - ref).abs().max() / ref.abs().max()).item() < 2e-2
    ids = torch.tensor([0, 5, 159])  # tied-embedding lookups read only their rows
    torch.testing.assert_close(lin.embedding(ids), dequantize(qw)[ids], atol=1e-6, rtol=0)


def test_int8_kernel_keeps_packed_bytes():
    w = torch.randn(256, 512)
    lin = build_linear(quantize_rtn(w, 8, 512, True), None, torch.device("cpu"), torch.float32)
    assert lin.weight.dtype == torch.int8 and lin.weight.shape == (256, 512)  # no float copy of the weight
    lin4 = build_linear(quantize_rtn(w, 4, 64, False), None, torch.device("cpu"), torch.float32)
    assert sum(t.numel() * t.element_size() for t in lin4.tensors()) < w.numel() * 4 / 6


def test_fp8_weights_and_linear():
    torch.manual_seed(0)
    w, x = torch.randn(128, 256), torch.randn(4, 256)
    fw = quantize_fp8(w)
    assert fw.data.dtype == torch.float8_e4m3fn
    assert ((dequantize_fp8(fw) - w).norm() / w.norm()).item() < 0.04  # e4m3: 3 mantissa bits
    lin = build_linear(fw, None, torch.device("cpu"), torch.float32)
    assert isinstance(lin, Fp8Linear)
    ref = x @ w.T
    assert ((lin(x) - ref).norm() / ref.norm()).item() < 0.08  # weights and per-token activations in e4m3


def _correlated_inputs(n=2048, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    x = torch.randn(n, k, generator=g) @ mix
    x[:, :4] *= 12.0  # a few salient channels with large activations
    return x


def test_gptq_beats_round_to_nearest_on_layer_output():
    from pagedllm.quantize.gptq import gptq_quantize

    torch.manual_seed(0)
    x = _correlated_inputs()
    w = torch.randn(64, 128)
    ref = x @ w.T
    rtn = quantize_rtn(w, 4, 32, False)
    gq, _ = gptq_quantize(w, x.T.double() @ x.double(), 4, 32, False)
    err = lambda q: ((x @ dequantize(q).T - ref) ** 2).mean().item()  # noqa: E731
    assert gq.codes.dtype == torch.uint8 and gq.scales.shape == (64, 4)
    assert err(gq) < 0.8 * err(rtn)


def test_awq_protects_salient_channels():
    from pagedllm.quantize.awq import awq_quantize
    from pagedllm.quantize.calibrate import LinearStats

    torch.manual_seed(0)
    x = _correlated_inputs()
    stats = LinearStats(128, want_hessian=False, max_rows=1024, seed=0)
    for chunk in x.split(256):
        stats.add(chunk)
    w = torch.randn(64, 128)
    qw, info = awq_quantize(w, stats, 4, 64, False)
    ref = x @ w.T
    err = lambda q: ((x @ dequantize(q).T - ref) ** 2).mean().item()  # noqa: E731
    assert info["alpha"] > 0 and qw.input_scale is not None
    assert qw.input_scale[:4].mean() > qw.input_scale[4:].mean()  # salient channels scaled up
    assert err(qw) < 0.9 * err(quantize_rtn(w, 4, 64, False))


def test_gguf_native_q4_1_blocks_equal_the_files_numbers():
    import gguf

    from pagedllm.config import default_model_path
    from pagedllm.quant.gguf_blocks import decode

    reader = gguf.GGUFReader(default_model_path())
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert t.tensor_type.name == "Q4_1"
    qw = decode(t.data, "Q4_1")
    ref = torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    assert qw.group_size == 32 and qw.shape == tuple(ref.shape)
    assert torch.equal(dequantize(qw), ref)  # the file's offsets as they are: bit for bit


def test_dense_copy_for_large_steps():
    """--quant-dense-min-tokens: steps with many rows use a bf16 copy of the effective weight, small ones the
    packed kernel; both compute the same layer."""
    torch.manual_seed(3)
    w = torch.randn(128, 256)
    qw = quantize_rtn(w, 4, 64, False)
    qw.input_scale = torch.rand(256) + 0.5
    lin = build_linear(qw, None, torch.device("cpu"), torch.float32, dense_min_tokens=8)
    assert lin.dense is not None and all(any(t is d for t in lin.tensors()) for d in lin.dense.tensors())
    assert lin.dense.packed is not None or lin.dense.weight.dtype == torch.bfloat16
    ref_w = dequantize(qw)
    calls = []
    packed = lin._mm
    lin._mm = lambda *a: calls.append(a[0].shape[0]) or packed(*a)
    for m in (1, 7, 8, 40):
        x = torch.randn(m, 256)
        ref = x @ ref_w.T
        assert ((lin(x) - ref).abs().max() / ref.abs().max()).item() < 2e-2
    assert calls == [1, 7]  # 8 and 40 rows went to the dense copy
    plain = build_linear(qw, None, torch.device("cpu"), torch.float32)
    assert plain.dense is None
