"""The fused CPU kernels (pagedllm/kernels/csrc/) against the torch operations they replace.

The kernels must build here: this machine (and CI) has a C++ compiler, and the engine's CPU speed depends on them.
"""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_ops
from pagedllm.layers.attention import decode_attention, write_kv
from pagedllm.layers.linear import DenseLinear
from pagedllm.layers.norm import rms_norm
from pagedllm.layers.ops import TorchOps
from pagedllm.layers.rotary import RotaryEmbedding
from helpers import model_of
import kernel_builds
from kernel_builds import ARM_TARGETS, LEVELS

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def ops():
    m = cpu_ops()
    assert m is not None, "the fused CPU kernels did not build (see the warning logged by pagedllm.kernels)"
    return m


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    a, b = a.float(), b.float()
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
    assert err < TOL[dtype], err


# D=64/128 with up to 8 query heads per KV head take the AVX-512 path; D=32 and G=9 the portable one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (14, 2, 128), (8, 2, 32), (9, 1, 64), (4, 1, 256)])
def test_decode_attention_matches_sdpa(ops, dtype, hq, hkv, d):
    torch.manual_seed(hq * d)
    bs, nb = 16, 64
    kc, vc = torch.randn(nb, bs, hkv, d, dtype=dtype), torch.randn(nb, bs, hkv, d, dtype=dtype)
    lens = torch.tensor([1, 15, 16, 17, 100, 200])  # partial and full blocks
    max_blocks = 13
    tables = torch.stack([torch.randperm(nb)[:max_blocks] for _ in lens])  # blocks scattered over the cache
    q = torch.randn(len(lens), hq, d, dtype=dtype)
    mask = (torch.arange(max_blocks * bs)[None] < lens[:, None])[:, None, None, :]
    ref = decode_attention(q, kc, vc, tables, mask, d ** -0.5)
    out = ops.decode_attention(q, kc, vc, tables, lens, d ** -0.5)
    _close(out, ref, dtype)
    for rows in ([0], [5], [3, 4]):  # one or two sequences are split per KV head over the threads: same numbers
        r = torch.tensor(rows)
        assert torch.equal(ops.decode_attention(q[r], kc, vc, tables[r], lens[r], d ** -0.5), out[r]), rows
    for window in (1, 12, 16, 40):  # sliding-window layers: the last `window` keys, from inside a block or not
        keep = mask & (torch.arange(max_blocks * bs) >= (lens - window)[:, None])[:, None, None, :]
        _close(ops.decode_attention(q, kc, vc, tables, lens, d ** -0.5, window),
               decode_attention(q, kc, vc, tables, keep, d ** -0.5), dtype)
    # soft-capped scores (gemma 2): large queries push the scores past the cap, so capping changes the output
    # The 8x larger scores magnify rounding: a float32 reference differs from itself by up to 2.4e-4 between runs on a
    # busy machine (BLAS picks its threads by the load), so the reference is computed in float64.
    big = q * 8
    capped = ops.decode_attention(big, kc, vc, tables, lens, d ** -0.5, 0, 5.0)
    wide = (lambda t: t.double()) if dtype == torch.float32 else (lambda t: t)
    _close(capped, decode_attention(wide(big), wide(kc), wide(vc), tables, mask, d ** -0.5, softcap=5.0), dtype)
    assert not torch.allclose(capped.float(), ops.decode_attention(big, kc, vc, tables, lens, d ** -0.5).float(),
                              atol=0.05)
    _close(ops.decode_attention(big, kc, vc, tables, lens, d ** -0.5, 12, 5.0),
           decode_attention(big, kc, vc, tables, mask & (torch.arange(max_blocks * bs) >= (lens - 12)[:, None])[
               :, None, None, :], d ** -0.5, softcap=5.0), dtype)
    # attention sinks (gpt-oss): a logit per query head in each softmax's denominator, alone and with a window;
    # the torch path checked against the softmax over [scores, sink] written out
    sinks = torch.randn(hq) * 2 + 1
    sunk = ops.decode_attention(q, kc, vc, tables, lens, d ** -0.5, 0, 0.0, sinks)
    _close(sunk, decode_attention(q, kc, vc, tables, mask, d ** -0.5, sinks=sinks), dtype)
    g = hq // hkv
    for b in (1, 4):
        keys = kc[tables[b]].reshape(-1, hkv, d)[:lens[b]].float().repeat_interleave(g, dim=1)
        vals = vc[tables[b]].reshape(-1, hkv, d)[:lens[b]].float().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].float(), keys) * d ** -0.5
        p = torch.cat([s, sinks[:, None]], dim=1).softmax(-1)[:, :-1]
        _close(sunk[b], torch.einsum("hl,lhd->hd", p, vals), dtype)
    assert not torch.allclose(sunk.float(), out.float(), atol=0.05)
    keep = mask & (torch.arange(max_blocks * bs) >= (lens - 12)[:, None])[:, None, None, :]
    _close(ops.decode_attention(q, kc, vc, tables, lens, d ** -0.5, 12, 0.0, sinks),
           decode_attention(q, kc, vc, tables, keep, d ** -0.5, sinks=sinks), dtype)


def test_decode_attention_strided_query_and_bad_input(ops):
    torch.manual_seed(0)
    kc, vc = torch.randn(8, 16, 3, 64), torch.randn(8, 16, 3, 64)
    qkv = torch.randn(2, (9 + 6) * 64)
    q = qkv[:, : 9 * 64].view(2, 9, 64)  # a view into the fused projection's output, as the model passes it
    tables, lens = torch.tensor([[3, 1], [0, 5]]), torch.tensor([20, 32])
    mask = (torch.arange(32)[None] < lens[:, None])[:, None, None, :]
    _close(ops.decode_attention(q, kc, vc, tables, lens, 0.125), decode_attention(q, kc, vc, tables, mask, 0.125),
           torch.float32)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.decode_attention(q, kc, vc, tables, torch.tensor([20, 33]), 0.125)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        ops.decode_attention(q.half(), kc, vc, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.decode_attention(q, kc, vc.bfloat16(), tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="outside the cache"):  # a bad block id is refused, not read
        ops.decode_attention(q, kc, vc, torch.tensor([[3, 8], [0, 5]]), lens, 0.125)
    for sinks in (torch.zeros(8), torch.zeros(9, dtype=torch.float64)):  # one per query head, float32
        with pytest.raises(RuntimeError, match="sinks must be"):
            ops.decode_attention(q, kc, vc, tables, lens, 0.125, 0, 0.0, sinks)


def test_mamba2_step_updates_the_states_in_place(ops):
    """Mamba-2's decode recurrence (``layers.mamba2``): the kernel's states and outputs are the torch path's, the
    states written at their slots only."""
    torch.manual_seed(3)
    bsz, h, p, n, slots_n = 3, 4, 16, 32, 6
    pool = torch.randn(slots_n, h, p, n)
    slots = torch.tensor([4, 0, 2])
    x, dt = torch.randn(bsz, h, p), torch.rand(bsz, h) * 2
    b, c = torch.randn(bsz, h, n), torch.randn(bsz, h, n)
    a, d = -torch.rand(h) * 4, torch.randn(h)
    want = pool.clone()
    st = want[slots]
    st.mul_((dt * a).exp()[..., None, None]).add_((x * dt.unsqueeze(-1)).unsqueeze(-1) * b.unsqueeze(-2))
    want[slots] = st
    y_want = (st * c.unsqueeze(-2)).sum(-1) + x * d[:, None]
    y = ops.mamba2_step(x, dt, b, c, a, d, pool, slots)
    torch.testing.assert_close(y, y_want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="outside the pool or repeated"):
        ops.mamba2_step(x, dt, b, c, a, d, pool, torch.tensor([4, 4, 2]))


@pytest.mark.parametrize("hkv,d,width", [(1, 256, 512), (2, 64, 256), (2, 16, 64)])
def test_caches_viewed_in_wider_rows(ops, hkv, d, width):
    """Gemma 4's layers of different head shapes share cache tensors whose token rows are the widest layer's
    (``width`` values); a narrower layer's cache is a view of each row's first hkv * d values. The rotary + KV
    write lands there (and nowhere else), decode attention reads it (the vector paths for d 64 / 256, the portable
    one for 16) as from a contiguous copy; with no KV heads the kernel turns q alone and writes nothing."""
    torch.manual_seed(d)
    nb, bs, hq, t = 6, 16, 4 * hkv, 5
    rows = [torch.zeros(nb, bs, width) for _ in range(2)]
    kc, vc = (r[..., : hkv * d].unflatten(-1, (hkv, d)) for r in rows)
    assert not kc.is_contiguous()
    cos, sin = torch.randn(64, d // 2), torch.randn(64, d // 2)
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    slots, positions = torch.tensor([3, 17, 18, 40, 95]), torch.tensor([3, 1, 2, 40, 63])
    want_qkv, want_k, want_v = qkv.clone(), torch.zeros(nb, bs, hkv, d), torch.zeros(nb, bs, hkv, d)
    step = (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))  # the torch path's per-step rows
    TorchOps().rope_write_kv(want_qkv, positions, *step, slots, want_k, want_v, hq, hkv)
    ops.rope_write_kv(qkv, positions, cos, sin, slots, kc, vc, hq, hkv)
    torch.testing.assert_close(qkv[:, : hq * d], want_qkv[:, : hq * d])  # q turned in place (k: into the cache)
    torch.testing.assert_close(kc, want_k)
    torch.testing.assert_close(vc, want_v)
    assert not rows[0][..., hkv * d:].any() and not rows[1][..., hkv * d:].any()  # the rest of each row untouched
    q_only = torch.randn(t, hq * d)
    turned = q_only.clone()
    ops.rope_write_kv(turned, positions, cos, sin, slots, kc, vc, hq, 0)
    torch.testing.assert_close(turned.view(t, hq, d), RotaryEmbedding.apply(step, q_only.view(t, hq, d)))
    torch.testing.assert_close(kc, want_k)  # nothing written
    for r in rows:
        r.normal_()
    lens, tables = torch.tensor([1, 20, 70]), torch.tensor([[5, 0, 1, 2, 3], [2, 4, 0, 1, 3], [1, 3, 5, 0, 4]])
    q = torch.randn(3, hq, d)
    torch.testing.assert_close(ops.decode_attention(q, kc, vc, tables, lens, d ** -0.5),
                               ops.decode_attention(q, kc.contiguous(), vc.contiguous(), tables, lens, d ** -0.5))


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 32)])  # the vector path and the portable one
def test_decode_attention_on_bfloat16_caches(ops, hq, hkv, d):
    """Float32 queries over bfloat16 caches (``--kv-cache-dtype bfloat16``): the float32 kernel's output on the same
    rounded K/V to float32 rounding (the bfloat16 path sums each dot product's elements in another order: even,
    then odd ones), and close to the torch path on them."""
    torch.manual_seed(hq + d)
    bs, nb = 16, 40
    kc, vc = torch.randn(nb, bs, hkv, d).bfloat16(), torch.randn(nb, bs, hkv, d).bfloat16()
    lens = torch.tensor([1, 16, 33, 150])
    tables = torch.stack([torch.randperm(nb)[:10] for _ in lens])
    q = torch.randn(len(lens), hq, d)
    out = ops.decode_attention(q, kc, vc, tables, lens, d ** -0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ops.decode_attention(q, kc.float(), vc.float(), tables, lens, d ** -0.5),
                               rtol=1e-5, atol=1e-6)
    mask = (torch.arange(10 * bs)[None] < lens[:, None])[:, None, None, :]
    _close(out, decode_attention(q, kc, vc, tables, mask, d ** -0.5), torch.float32)
    assert torch.equal(ops.decode_attention(q[:1], kc, vc, tables[:1], lens[:1], d ** -0.5), out[:1])  # head split


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norms(ops, dtype):
    torch.manual_seed(1)
    h = torch.randn(5, 576, dtype=dtype) * 3
    w = torch.rand(576, dtype=dtype) + 0.5
    delta = torch.randn(5, 576, dtype=dtype)
    _close(ops.rms_norm(h, w, 1e-5), rms_norm(h, w, 1e-5), dtype)
    h2 = h.clone()
    out = ops.add_rms_norm(h2, delta, w, 1e-5)
    assert torch.equal(h2, h + delta)  # the residual stream is updated in place, rounded like a torch add
    _close(out, rms_norm(h + delta, w, 1e-5), dtype)


def test_norms_of_float32_rows_under_bfloat16_linears(ops):
    """An encoder's float32 residual rows with bfloat16 linears: the norms take the linear's bfloat16 output as
    the delta and write the next linear's bfloat16 input: the same numbers as adding in float32 (torch), then
    normalising in float32 and rounding once (the cast the linear did)."""
    torch.manual_seed(2)
    h = torch.randn(7, 384) * 3
    w, b = torch.rand(384) + 0.5, torch.randn(384) * 0.1
    delta = torch.randn(7, 384).bfloat16()
    ref = rms_norm(h + delta, w, 1e-6)
    for out_bf16 in (False, True):
        h2 = h.clone()
        out = ops.add_rms_norm(h2, delta, w, 1e-6, out_bf16)
        assert torch.equal(h2, h + delta)  # float32 rows, the bfloat16 delta added exactly as torch adds it
        assert out.dtype == (torch.bfloat16 if out_bf16 else torch.float32)
        _close(out, ref, torch.bfloat16 if out_bf16 else torch.float32)
        if out_bf16:  # one rounding of the float32 result
            assert (out == ref.bfloat16()).float().mean() > 0.99
    assert torch.equal(ops.rms_norm(h, w, 1e-6, True).float(), ops.rms_norm(h, w, 1e-6).bfloat16().float())
    # BERT's post-norm: LayerNorm(h + delta) in place, and its bfloat16 copy
    h2 = h.clone()
    x = ops.add_layer_norm(h2, delta, w, b, 1e-12)
    ref = F.layer_norm(h + delta, (384,), w, b, 1e-12)
    _close(h2, ref, torch.float32)
    assert x.dtype == torch.bfloat16 and torch.equal(x, h2.bfloat16())
    h2 = h.clone()
    ops.add_layer_norm(h2, delta.float(), w, b, 1e-12)  # a float32 delta too
    _close(h2, ref, torch.float32)
    with pytest.raises(RuntimeError, match="residual branch"):
        ops.add_rms_norm(h.bfloat16(), delta.float(), w, 1e-6)


@pytest.mark.parametrize("hq,hkv,d", [(12, 12, 32), (3, 1, 256), (4, 2, 64)])
def test_encoder_attention_tiles_match_sdpa(ops, hq, hkv, d):
    """An encoder's attention on AMX-BF16 tiles (BERT's heads of 32, EmbeddingGemma's 256 with one kv head):
    each text's rows attend to all of its rows, whatever the length (partial tiles of keys and queries, one-row
    texts), within the bfloat16 rounding of the probabilities and the output of the float32 reference."""
    if not ops.encoder_attention_tiles():  # (a CPU without AMX-BF16: the encoder keeps torch's SDPA, tested below)
        with pytest.raises(RuntimeError, match="AMX-BF16"):
            ops.encoder_attention(*(torch.zeros(1, 1, 32, dtype=torch.bfloat16),) * 3, torch.tensor([[0, 1]]), 1.0)
        return
    from pagedllm.layers.attention import bidirectional_attention
    torch.manual_seed(d)
    lens = [1, 5, 16, 17, 31, 32, 33, 150, 247]
    spans, s = [], 0
    for n in lens:
        spans.append((s, s + n))
        s += n
    qkv = (torch.randn(s, (hq + 2 * hkv) * d) * 2).bfloat16()  # strided views of one projection, as the model's
    q = qkv[:, : hq * d].view(s, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(s, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(s, hkv, d)
    out = ops.encoder_attention(q, k, v, torch.tensor(spans), d ** -0.5).float()
    ref = bidirectional_attention(q.float(), k.float(), v.float(), spans, d ** -0.5)
    rel = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 6e-3, rel  # (bfloat16 output rounding alone: ~3e-3)
    a, e = spans[7]  # a text alone: bitwise its numbers in the batch
    one = ops.encoder_attention(q[a:e], k[a:e], v[a:e], torch.tensor([[0, e - a]]), d ** -0.5)
    assert torch.equal(one, out[a:e].bfloat16())
    with pytest.raises(RuntimeError, match="span"):
        ops.encoder_attention(q, k, v, torch.tensor([[0, s + 1]]), 1.0)


def test_encoder_ops_rotary_in_place_matches_torch(ops):
    """EncoderOps turns q and k in place with the fused rotary kernel (no cache written): the torch rotary's
    numbers."""
    from pagedllm.layers.ops import EncoderOps
    torch.manual_seed(4)
    t, nq, nkv, d = 9, 3, 1, 64
    rot = RotaryEmbedding(d, 512, 10000.0, torch.device("cpu"), torch.float32)
    qkv = torch.randn(t, (nq + 2 * nkv) * d)
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 5, 6, 7])
    ref = qkv.clone()
    TorchOps().rope_write_kv(ref, pos, *TorchOps().step_rotary(rot, pos), None, None, None, nq, nkv)
    enc = EncoderOps(ops)
    got = qkv.clone()
    enc.rope_write_kv(got, pos, *enc.step_rotary(rot, pos), None, None, None, nq, nkv)
    _close(got, ref, torch.float32)
    assert torch.equal(got[:, (nq + nkv) * d:], qkv[:, (nq + nkv) * d:])  # v untouched


def test_float32_norm_weight_multiplies_in_float32(ops):
    """Gemma's RMSNorm under bfloat16 activations (a float32 1 + w): x normalized and times the weight in float32,
    rounded once, as HF computes ``x * (1 + w.float())``. The torch path, rms_norm, add_rms_norm and qk_norm all
    give the once-rounded values; rounding the normalized x first (llama's order) or the weight to bfloat16 does not.
    """
    torch.manual_seed(3)
    t, nq, nkv, d = 6, 4, 1, 256
    w = 1 + torch.randn(d) * 0.3  # float32, not representable in bfloat16
    h = (torch.randn(t, d) * 3).bfloat16()
    delta = torch.randn(t, d).bfloat16()

    def once(x: torch.Tensor) -> torch.Tensor:  # float64 arithmetic, one rounding
        xd = x.double()
        return (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()).bfloat16()

    def agree(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a == b).float().mean().item()

    ref = once(h)
    assert agree(rms_norm(h, w, 1e-6), ref) > 0.99
    assert agree(ops.rms_norm(h, w, 1e-6), ref) > 0.99
    h2 = h.clone()
    assert agree(ops.add_rms_norm(h2, delta, w, 1e-6), once(h + delta)) > 0.99
    assert torch.equal(h2, h + delta)
    qkv = (torch.randn(t, (nq + 2 * nkv) * d) * 3).bfloat16()
    heads = qkv[:, : (nq + nkv) * d].reshape(t, nq + nkv, d).clone()
    ops.qk_norm(qkv, w, w, nq, nkv, 1e-6)
    assert agree(qkv[:, : (nq + nkv) * d].reshape(t, nq + nkv, d), once(heads)) > 0.99
    # what the float32 weight changes: llama's order with the weight in bfloat16 misses the once-rounded values
    assert agree(ops.rms_norm(h, w.bfloat16(), 1e-6), ref) < 0.9
    assert agree(rms_norm(h, w.bfloat16(), 1e-6), ref) < 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv(ops, dtype):
    torch.manual_seed(2)
    nq, nkv, d, t = 9, 3, 64, 7
    rope = RotaryEmbedding(d, 512, 10000.0, torch.device("cpu"), dtype)
    qkv = torch.randn(t, (nq + 2 * nkv) * d, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 100, 101, 300, 511])
    slots = torch.tensor([5, 6, 7, 40, 41, 63, 0])
    kc, vc = torch.zeros(4, 16, nkv, d, dtype=dtype), torch.zeros(4, 16, nkv, d, dtype=dtype)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    qk = rope(positions, qkv[:, : (nq + nkv) * d].reshape(t, nq + nkv, d).float()).to(dtype)
    write_kv(ref_kc, ref_vc, qk[:, nq:], qkv[:, (nq + nkv) * d:].reshape(t, nkv, d), slots)
    ref_q = qk[:, :nq]
    ops.rope_write_kv(qkv, positions, rope.cos32, rope.sin32, slots, kc, vc, nq, nkv)
    _close(qkv[:, : nq * d].view(t, nq, d), ref_q, dtype)  # q rotated in place
    _close(kc, ref_kc, dtype)
    assert torch.equal(vc, ref_vc)  # v copied as is
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_write_kv(qkv, positions, rope.cos32, rope.sin32, slots + 60, kc, vc, nq, nkv)
    with pytest.raises(RuntimeError, match="rotary table"):
        ops.rope_write_kv(qkv, positions + 1, rope.cos32, rope.sin32, slots, kc, vc, nq, nkv)


def test_rope_write_kv_into_bfloat16_caches(ops):
    """Float32 q/k/v written to bfloat16 caches: q as in float32, k and v the float32 results rounded to nearest
    even, here equal to torch's rounding (``write_kv`` of the torch path; the AVX512-BF16 instruction flushes
    denormals to zero, which torch keeps)."""
    torch.manual_seed(4)
    nq, nkv, d, t = 9, 3, 64, 5
    rope = RotaryEmbedding(d, 256, 10000.0, torch.device("cpu"), torch.float32)
    qkv = torch.randn(t, (nq + 2 * nkv) * d)
    positions, slots = torch.tensor([0, 3, 17, 100, 255]), torch.tensor([1, 2, 30, 31, 47])
    kc32, vc32 = torch.zeros(3, 16, nkv, d), torch.zeros(3, 16, nkv, d)
    kc, vc = kc32.bfloat16(), vc32.bfloat16()
    q32 = qkv.clone()
    ops.rope_write_kv(q32, positions, rope.cos32, rope.sin32, slots, kc32, vc32, nq, nkv)
    ops.rope_write_kv(qkv, positions, rope.cos32, rope.sin32, slots, kc, vc, nq, nkv)
    assert torch.equal(qkv, q32)
    assert torch.equal(kc, kc32.bfloat16()) and torch.equal(vc, vc32.bfloat16())
    ref_kc, ref_vc = torch.zeros_like(kc), torch.zeros_like(vc)
    write_kv(ref_kc, ref_vc, kc32.view(-1, nkv, d)[slots], vc32.view(-1, nkv, d)[slots], slots)
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.rope_write_kv(qkv, positions, rope.cos32, rope.sin32, slots, kc, vc32, nq, nkv)
    # bfloat16 activations over float32 caches: k and v as the bfloat16 run writes them (k rounded to bfloat16
    # after the rotation, as the torch path computes it), widened
    qb, qb2 = qkv.bfloat16(), qkv.bfloat16()
    kb, vb = torch.zeros(3, 16, nkv, d, dtype=torch.bfloat16), torch.zeros(3, 16, nkv, d, dtype=torch.bfloat16)
    kf, vf = torch.zeros(3, 16, nkv, d), torch.zeros(3, 16, nkv, d)
    ops.rope_write_kv(qb, positions, rope.cos32, rope.sin32, slots, kb, vb, nq, nkv)
    ops.rope_write_kv(qb2, positions, rope.cos32, rope.sin32, slots, kf, vf, nq, nkv)
    assert torch.equal(qb, qb2) and torch.equal(kf, kb.float()) and torch.equal(vf, vb.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_and_mul(ops, dtype):
    torch.manual_seed(3)
    gu = torch.randn(3, 2 * 40, dtype=dtype) * 4  # 40: two vector chunks of 16 and a scalar tail
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0], dtype=dtype)
    g, u = gu.float().chunk(2, dim=-1)
    _close(ops.silu_and_mul(gu), (F.silu(g) * u).to(dtype), dtype)
    # gemma's GeGLU: GELU with the tanh approximation, as torch (and HF transformers' gelu_pytorch_tanh) computes it;
    # elementwise, including the saturated ends (|x| = 100, -30) and a gate of 0
    ref = (F.gelu(g.double(), approximate="tanh") * u.double())
    got = ops.gelu_tanh_and_mul(gu).double()
    if dtype == torch.float32:
        assert torch.allclose(got, ref, rtol=2e-6, atol=1e-6), (got - ref).abs().max()
    else:
        _close(got, ref.to(dtype), dtype)
    # gpt-oss's clamped SwiGLU (its gates and ups reach past the clamp of 7 here), against the torch operations
    from pagedllm.layers.ops import TorchOps

    gu[1, :2] = torch.tensor([float("nan"), 12.0], dtype=dtype)  # a NaN passes through the clamp, as in torch
    ref = TorchOps().act_and_mul("swiglu_oai")(gu.double())
    got = ops.swiglu_oai_and_mul(gu).double()
    assert torch.isnan(got[1, 0]) and torch.isnan(ref[1, 0])
    got[1, 0] = ref[1, 0] = 0.0
    if dtype == torch.float32:
        assert torch.allclose(got, ref, rtol=2e-6, atol=1e-6), (got - ref).abs().max()
    else:
        _close(got, ref.to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 256, 40])
def test_qk_norm_in_place_per_head(ops, dtype, d):
    """Each q head and each k head of qkv's rows normalised in place with its own weight; v untouched."""
    torch.manual_seed(d)
    t, nq, nkv = 5, 4, 2
    qkv = torch.randn(t, (nq + 2 * nkv) * d, dtype=dtype) * 3
    qw, kw = torch.randn(d, dtype=dtype), torch.randn(d, dtype=dtype)
    ref = qkv.clone()
    q, k = ref[:, : nq * d].view(t, nq, d), ref[:, nq * d : (nq + nkv) * d].view(t, nkv, d)
    q.copy_(rms_norm(q, qw, 1e-6))
    k.copy_(rms_norm(k, kw, 1e-6))
    wide = torch.cat([qkv, torch.zeros(t, 7, dtype=dtype)], dim=1)[:, : qkv.shape[1]]  # rows of stride width + 7
    for x in (qkv, wide):
        ops.qk_norm(x, qw, kw, nq, nkv, 1e-6)
        _close(x, ref, dtype)
        assert torch.equal(x[:, (nq + nkv) * d :], ref[:, (nq + nkv) * d :])  # v as it was


def test_dense_linear_is_float64_close_and_each_row_the_same_at_any_batch(ops):
    """The float32 path's linear (dense.cpp): x W^T + b within float32 rounding of the float64 product, for shapes
    with partial tiles of rows and outputs, inputs past the last vector and fewer inputs than a vector; a row's
    outputs bitwise the same alone, in any batch and at any position (what the engine's batched == alone rests on);
    DenseLinear runs it for float32 weights and keeps torch's F.linear numbers to float32 rounding."""
    from pagedllm.layers.linear import DenseLinear

    torch.manual_seed(11)
    # (100, 1536): three chunks of rows (42 rows of 1536 inputs stay in L2), claims across their boundaries
    for m, n, k in [(1, 1, 1), (1, 7, 5), (3, 33, 576), (7, 50, 100), (13, 9, 1536), (100, 21, 1536), (64, 130, 64)]:
        x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        ref = (x.double() @ w.double().T + b.double()).float()
        tol = 1e-5 * (x.abs().double() @ w.abs().double().T).max().item() + 1e-6
        for bias in (b, None):
            y = ops.dense_linear(x, w, bias)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert (y - (ref if bias is not None else ref - b)).abs().max().item() <= tol, (m, n, k)
        y = ops.dense_linear(x, w, b)
        for i in range(m):  # each row alone, and inside batches of other sizes around it
            assert torch.equal(ops.dense_linear(x[i:i + 1], w, b), y[i:i + 1]), (m, n, k, i)
            mixed = torch.cat([torch.randn(i % 5, k), x[i:i + 1], torch.randn(2, k)])
            assert torch.equal(ops.dense_linear(mixed, w, b)[i % 5], y[i]), (m, n, k, i)
    lin = DenseLinear(w, b)
    assert lin.kernels is ops
    assert torch.allclose(lin(x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert torch.equal(lin(x.reshape(8, 8, k)), lin(x).reshape(8, 8, n))
    assert torch.equal(lin(x.T.contiguous().T), lin(x))  # a strided view: its rows copied, the same numbers
    assert DenseLinear(w, b, large_steps=True).kernels is None  # a packed layer's copy for large steps: MKL's GEMM
    with pytest.raises(RuntimeError, match="float32"):
        ops.dense_linear(x.double(), w.double())
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.dense_linear(x, torch.randn(k, n).T)


def test_argmax_rows_is_torch_max_indices(ops):
    """Greedy sampling's kernel: each row's first maximum exactly as ``torch.max(dim=-1).indices`` gives it, ties,
    infinities, NaNs (the first NaN wins), vector tails and strided rows included."""
    from pagedllm.sample.sampler import Sampler

    torch.manual_seed(5)
    for shape in [(32, 49152), (1, 49152), (5, 7), (3, 17), (4, 1)]:
        x = torch.randn(shape)
        assert torch.equal(ops.argmax_rows(x), x.max(-1).indices), shape
    x = torch.randn(7, 100)
    x[0, 10] = x[0, 70] = 50.0  # a tie: the first
    x[1] = float("-inf")
    x[2, 5] = x[2, 60] = float("inf")
    x[3, 3], x[3, 40], x[3, 90] = 100.0, float("nan"), float("nan")
    x[4, 99] = float("nan")  # in the scalar tail
    x[5, 97] = 1000.0
    x[6, 20], x[6, 21] = -0.0, 0.0
    x[6] = torch.where(torch.arange(100) < 20, -1.0, x[6].clamp(max=-0.5))
    x[6, 20], x[6, 21] = -0.0, 0.0
    assert torch.equal(ops.argmax_rows(x), x.max(-1).indices), (ops.argmax_rows(x), x.max(-1).indices)
    strided = torch.randn(8, 300)[:, :257]
    assert torch.equal(ops.argmax_rows(strided), strided.max(-1).indices)
    assert torch.equal(Sampler(ops).argmax(x), Sampler().argmax(x))
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(x.double())
    with pytest.raises(RuntimeError, match="n > 0"):
        ops.argmax_rows(torch.zeros(2, 0))


def test_prepacked_bf16_linear_matches_f_linear():
    torch.manual_seed(4)
    w, b = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    lin = DenseLinear(w.clone(), b).prepack(keep_weight=False)
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert lin.packed is not None and lin.weight is None
    else:  # no bf16 in this CPU's oneDNN (e.g. Zen 3): prepack is a no-op and torch's GEMM runs the weight as it is
        assert lin.packed is None and lin.weight is not None
    for m in (1, 5, 40):
        x = torch.randn(m, 64, dtype=torch.bfloat16)
        _close(lin(x), F.linear(x, w, b), torch.bfloat16)
    f32 = DenseLinear(torch.randn(8, 4)).prepack(keep_weight=False)
    assert f32.packed is None and f32.weight is not None  # float32 keeps torch's own GEMM (exact HF match)


def test_engine_rows_through_the_kernel_keep_their_order():
    """Prefix hits turn some prompts' last chunk into one-token rows listed before the other prompts' prefill
    rows: the kernel's rows must still come back in the batch's order (greedy tokens as each prompt alone)."""
    from conftest import PROMPTS
    from pagedllm import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=4)
    llm = LLM(dtype="float32")
    assert model_of(llm).ops.fused
    alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    batch = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    assert batch == alone


def test_fused_and_torch_paths_agree():
    """The torch path (CUDA, or no compiler) and the fused CPU path give the same greedy tokens and close
    logprobs on the engine's own steps: prefill, decode, and both mixed in one step."""
    from conftest import PROMPTS
    from pagedllm import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1)
    llm = LLM(dtype="float32", enable_prefix_caching=False)
    model = model_of(llm)
    fused = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert model.ops.fused
    ops, model.ops = model.ops, TorchOps()
    try:
        plain = llm.generate(PROMPTS, sp, use_tqdm=False)
    finally:
        model.ops = ops
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(la.logprob - lb.logprob) < 1e-3


@pytest.mark.parametrize("bits,group_size,symmetric", [(4, 32, False), (4, 32, True), (4, 64, False), (8, 32, True),
                                                       (8, 128, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_quant_linear_matches_dequantized_matmul(ops, bits, group_size, symmetric, dtype):
    """qlinear on packed blocks = the dequantized weight's matmul, up to the rounding of the activations to two
    int8 levels per block of 32 (about 15 bits): under 1e-3 relative error in float32; every batch size gives each
    row exactly the result it gets alone (whatever tile of rows and groups it ran in); 203 outputs: the last group
    of 8 rows is partial, and the groups split over two threads leave odd groups next to pairs of them."""
    from pagedllm.quant.formats import dequantize, quantize_rtn
    from pagedllm.quant.linear import BlockQuantLinear

    torch.manual_seed(bits * 100 + group_size)
    n, k = 203, 576 if group_size != 128 else 640  # 203 rows: the last group of 8 is partial
    qw = quantize_rtn(torch.randn(n, k) * torch.rand(n, 1), bits, group_size, symmetric)
    bias = torch.randn(n)
    lin = BlockQuantLinear(qw, bias, torch.device("cpu"), dtype, ops)
    w = dequantize(qw)
    torch.testing.assert_close(lin.dequantized(), w, rtol=0, atol=1e-5)
    x = torch.randn(11, k, dtype=dtype)
    x[3] = 0.0  # an all-zero row (scale 0) must give exactly the bias
    xl = torch.randn(100, k, dtype=dtype)  # more rows than one sweep of the groups (48): chunks of rows
    ref, refl = F.linear(x.float(), w, bias), F.linear(xl.float(), w, bias)
    for levels in (2, 1):  # 1: 8-bit activations (one int8 per input), on every vector path of this build
        lin.act_levels = levels
        tol = (1e-3 if levels == 2 else 1e-2) if dtype == torch.float32 else 0.02
        y = lin(x)
        assert y.dtype == dtype and y.shape == (11, n)
        rel = ((y.float() - ref).norm(dim=1) / ref.norm(dim=1)).max().item()
        assert rel < tol, (levels, rel)
        torch.testing.assert_close(y[3].float(), bias.to(dtype).float(), rtol=0, atol=0)
        for m in (1, 2, 3, 4, 5, 6, 7, 10):  # every row-tile shape and remainder: batch-invariant rows
            assert torch.equal(lin(x[:m]), y[:m]), (levels, m)
        for r in (0, 5, 10):
            assert torch.equal(lin(x[r:r + 1]), y[r:r + 1]), (levels, r)
        yl = lin(xl)
        assert ((yl.float() - refl).norm(dim=1) / refl.norm(dim=1)).max().item() < tol
        assert torch.equal(lin(xl[47:52]), yl[47:52]) and torch.equal(lin(xl[99:]), yl[99:])
        assert torch.equal(lin(xl[:1]), yl[:1]) and torch.equal(lin(xl[16:40]), yl[16:40])
    lin.act_levels = 2
    ids = torch.tensor([0, 7, n - 1])
    torch.testing.assert_close(lin.embedding(ids), w[ids].to(dtype), rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_block_quant_linear_keeps_awq_input_scaling(ops):
    from pagedllm.quant.formats import dequantize, quantize_rtn
    from pagedllm.quant.linear import BlockQuantLinear

    torch.manual_seed(5)
    qw = quantize_rtn(torch.randn(64, 256), 4, 32, False)
    qw.input_scale = torch.rand(256) + 0.5  # the layer computes (x / s) W'^T
    lin = BlockQuantLinear(qw, None, torch.device("cpu"), torch.float32, ops)
    x = torch.randn(3, 256)
    w = dequantize(qw)  # the effective weight, 1/s folded in
    torch.testing.assert_close(lin.dequantized(), w, rtol=1e-5, atol=1e-5)
    ref = F.linear(x, w)
    assert ((lin(x) - ref).norm() / ref.norm()).item() < 1e-3


def test_qlinear_float16_scales_and_absent_offsets(ops):
    """Scales and offsets as float16 (BlockQuantLinear keeps them so when each value is exactly a float16, as a
    GGUF file's are) and absent offsets (8-bit codes' all zero: Q8_0, symmetric weights) give bitwise the float32
    layout's results, at every row-tile shape (1, 2: the streamed single rows; 3+: the tiles; 50: two row chunks)
    and over pairs of groups and an odd one (5 groups)."""
    torch.manual_seed(11)
    k, ng = 96, 5
    n = 8 * ng - 3  # the last group is partial
    for bits in (4, 8):
        w = torch.randint(0, 256, (ng, k // 32 * bits * 32), dtype=torch.uint8)
        d = (torch.rand(ng, k // 32 * 8) * 0.1).half().float()
        m = (torch.randn(ng, k // 32 * 8) * 0.1).half().float()
        for rows in (1, 2, 3, 4, 7, 50):
            x = torch.randn(rows, k)
            y = ops.qlinear(x, w, d, m, bits, n)
            assert torch.equal(ops.qlinear(x, w, d.half(), m.half(), bits, n), y), (bits, rows)
            if bits == 8:  # 4-bit codes always have offsets (Q4_0's -8d; symmetric 4-bit likewise)
                y0 = ops.qlinear(x, w, d, torch.zeros_like(m), bits, n)
                assert not torch.equal(y0, y)
                for scales in (d, d.half()):
                    assert torch.equal(ops.qlinear(x, w, scales, scales.new_empty(0), bits, n), y0), rows
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        ops.qlinear(x, w, d.half(), m, 8, n)
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        ops.qlinear(x, w, d.double(), m.double(), 8, n)
    with pytest.raises(RuntimeError, match="offsets may be empty"):
        ops.qlinear(x, w, d, m[:1], 8, n)  # contiguous, one group's offsets only
    w4 = torch.randint(0, 256, (ng, k // 32 * 128), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="4-bit codes need their offsets"):
        ops.qlinear(x, w4, d, d.new_empty(0), 4, n)


def test_block_quant_linear_stores_float16_scales_only_when_exact(ops):
    """A GGUF-style weight (float16 scale and offset per block) keeps them as float16, 4 bytes per block instead of
    8, and computes exactly what the float32 layout computes; scales that float16 would round stay float32;
    symmetric weights store no offsets."""
    from pagedllm.quant.formats import dequantize, float16_blocks, quantize_rtn
    from pagedllm.quant.linear import BlockQuantLinear

    torch.manual_seed(12)
    qw = quantize_rtn(torch.randn(40, 128), 4, 32, False)
    lin32 = BlockQuantLinear(qw, None, torch.device("cpu"), torch.float32, ops)
    assert lin32.scales.dtype == lin32.offsets.dtype == torch.float32 and lin32.offsets.numel() == 40 * 4
    gguf = float16_blocks(qw)  # Q4_1: w = d q + m, both float16 in the file
    lin16 = BlockQuantLinear(gguf, None, torch.device("cpu"), torch.float32, ops)
    assert lin16.scales.dtype == lin16.offsets.dtype == torch.float16
    assert sum(t.numel() * t.element_size() for t in lin16.tensors()) == 40 * 128 // 2 + 40 * 4 * 4
    torch.testing.assert_close(lin16.dequantized(), dequantize(gguf), rtol=0, atol=1e-6)
    lin16f = BlockQuantLinear(gguf, None, torch.device("cpu"), torch.float32, ops)
    lin16f.scales, lin16f.offsets = lin16.scales.float(), lin16.offsets.float()  # the same values in float32
    x = torch.randn(5, 128)
    assert torch.equal(lin16(x), lin16f(x)) and torch.equal(lin16(x[:1]), lin16f(x[:1]))
    qs = quantize_rtn(torch.randn(16, 64), 8, 32, True)
    sym = BlockQuantLinear(qs, None, torch.device("cpu"), torch.float32, ops)
    assert sym.offsets.numel() == 0 and sym.scales.dtype == torch.float32
    qs.scales = qs.scales.half().float()  # as GGUF Q8_0: float16 scales, no offsets (a tied embedding / LM head)
    sym16 = BlockQuantLinear(qs, None, torch.device("cpu"), torch.float32, ops)
    assert sym16.offsets.numel() == 0 and sym16.scales.dtype == torch.float16
    ids = torch.tensor([[0, 9], [15, 3]])
    for lin, q in ((sym16, qs), (lin16, gguf)):  # embedding rows decode from the compact layout
        torch.testing.assert_close(lin.embedding(ids), dequantize(q)[ids], rtol=0, atol=1e-6)


def test_qlinear_rejects_bad_shapes(ops):
    x = torch.randn(2, 40)  # 40 is not a multiple of 32
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.qlinear(x, torch.zeros(1, 128, dtype=torch.uint8), torch.zeros(1, 8), torch.zeros(1, 8), 4, 8)
    x = torch.randn(2, 64)  # 2 blocks; 12 outputs: 2 groups of 8
    ok = (torch.zeros(2, 256, dtype=torch.uint8), torch.zeros(2, 16), torch.zeros(2, 16))
    assert ops.qlinear(x, *ok, 4, 12).shape == (2, 12)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.qlinear(x, torch.zeros(2, 128, dtype=torch.uint8), *ok[1:], 4, 12)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.qlinear(x, *ok, 4, 17)  # 3 groups needed
    with pytest.raises(RuntimeError, match="scales"):
        ops.qlinear(x, ok[0], torch.zeros(2, 8), ok[2], 4, 12)
    with pytest.raises(RuntimeError, match="bits"):
        ops.qlinear(x, *ok, 3, 12)


def test_kernels_release_the_gil(ops):
    """Another Python thread (the server's event loop) runs while a kernel computes: a thread that stamps the time
    in a loop leaves stamps inside one long qlinear call. Holding the GIL, it could leave none there (the margins
    cover the interpreter's 5 ms switch interval around the call)."""
    import threading
    import time

    n_out, k = 4096, 1536
    w = torch.randint(0, 256, ((n_out + 7) // 8, k // 32 * 128), dtype=torch.uint8)
    d, m = torch.rand((n_out + 7) // 8, k // 32 * 8), torch.rand((n_out + 7) // 8, k // 32 * 8)
    rows = 64  # as many rows as make one call last >= 0.15 s on this build (scalar builds are ~50x slower)
    while True:
        x = torch.randn(rows, k)
        t = time.perf_counter()
        ops.qlinear(x, w, d, m, 4, n_out)
        if time.perf_counter() - t >= 0.15 or rows >= 1 << 16:
            break
        rows *= 2
    stamps, stop = [], threading.Event()

    def spin():  # the sleep lets go of the GIL too: a build that holds it through the call still blocks the loop
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.0002)

    th = threading.Thread(target=spin)
    th.start()
    try:
        while not stamps:  # the thread is running
            pass
        t0 = time.perf_counter()
        ops.qlinear(x, w, d, m, 4, n_out)
        t1 = time.perf_counter()
        with pytest.raises(RuntimeError):  # an error inside a kernel still reaches Python (GIL taken back)
            ops.qlinear(torch.randn(2, 40), w, d, m, 4, n_out)
    finally:
        stop.set()
        th.join()
    margin = 0.02
    assert t1 - t0 > 4 * margin, f"the call took only {t1 - t0:.3f} s: too short to tell"
    inside = sum(t0 + margin < t < t1 - margin for t in stamps)
    assert inside > 20, f"{inside} stamps inside the {t1 - t0:.3f} s kernel call"


# ------------------------------------------------------------------ every x86-64 level, from a clean build
# Each level is compiled in a fresh process with its own extensions directory (no cache can hide a failed
# build); where this CPU can execute it, this file's kernel tests then run against that build. The levels build in
# the background while the rest of the suite runs (tests/kernel_builds.py), and their tests run last.
EXPECTED_ISA = {"x86-64": "scalar", "x86-64-v3": "avx2", "x86-64-v4": "avx512", "sapphirerapids": "avx512"}


def test_isa_matches_the_build_target(ops):
    """The vector path compiled in is the one the target level (or, for -march=native, this CPU) has."""
    import os
    import platform

    from pagedllm.kernels import cpu_info

    march = os.environ.get("PAGEDLLM_CPU_MARCH", "native")
    if march in EXPECTED_ISA:
        expect = EXPECTED_ISA[march]
    elif platform.machine() in ("aarch64", "arm64"):  # 64-bit ARM always has NEON
        expect = "neon"
    elif platform.machine() not in ("x86_64", "AMD64"):
        expect = "scalar"
    else:
        flags = cpu_info()[1]
        expect = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "scalar"
    assert ops.isa().startswith(expect), (march, ops.isa())


@pytest.mark.parametrize("march", LEVELS)
def test_kernels_build_and_pass_at_each_x86_level(march, kernel_builds_runs, ops):
    """Built from an empty cache; where this CPU runs it, every kernel test above passed against that build
    (test_isa_matches_the_build_target among them). A level whose vector-path macros are the native build's
    (e.g. x86-64-v3 on an AVX2-only CPU) compiles the same kernel source, which this file's tests ran against the
    native build: it is not built again."""
    from pagedllm.kernels import can_run, path_macros, target_march

    run = kernel_builds.result(kernel_builds_runs, ("level", march))
    if run == "native":  # its vector path is the native build's: tested by this file already
        assert path_macros(march) == path_macros(target_march()) and ops.isa().startswith(EXPECTED_ISA[march])
        return
    if isinstance(run, str):
        pytest.skip(run[len("skip: "):])
    rc, out, err = run
    assert rc == 0, out[-4000:] + err[-3000:]
    if can_run(march):
        assert " passed" in out and " failed" not in out, out[-2000:]
    else:  # compiled to an object file (which vector path it holds is checked where a CPU can run it)
        from pathlib import Path

        obj = Path(out.strip().splitlines()[-1])
        assert obj.stat().st_size > 100_000 and obj.read_bytes()[:4] == b"\x7fELF", (march, obj)


# ------------------------------------------------------------------ ARM, cross-compiled
# No ARM machine runs this suite, but users serve on Graviton and Apple M-series CPUs. zig's clang (the dev extra
# `ziglang`, which brings C/C++ headers and a libc for each target) compiles the kernels for both (in the background,
# tests/kernel_builds.py), so a change that breaks the NEON path fails here, not on a user's machine.


@pytest.mark.parametrize("target", ARM_TARGETS)
def test_kernels_compile_for_arm(target, kernel_builds_runs):
    """The kernels compile for ARM (Linux and macOS) to an object of that architecture holding the NEON vector path
    (its ``isa()`` names "neon"; "neon+dotprod" with qlinear's dot-product path), with no x86 code. Running it
    needs an ARM machine or emulation: ``tools/scripts/arm_emulated_tests.sh`` runs this file's kernel tests on aarch64
    under qemu."""
    from pathlib import Path

    rc, out, err = kernel_builds.result(kernel_builds_runs, ("arm", target))
    assert rc == 0, err[-4000:]
    data = Path(out.strip().splitlines()[-1]).read_bytes()
    magic, (offset, size, cpu), path = ARM_TARGETS[target]
    assert data[:4] == magic and int.from_bytes(data[offset:offset + size], "little") == cpu, (target, data[:20])
    assert len(data) > 100_000 and f"pagedllm-vector-path:{path}\x00".encode() in data and b"avx2" not in data


def test_a_lock_left_by_an_interrupted_build_does_not_hang_the_next_start(ops):
    """torch's extension loader waits, with no timeout, while its ``lock`` file exists in the build directory: a start
    killed during the first build left it, and every later start hung before its first log line. The next build
    removes it (under a file lock of its own) and loads the cached module."""
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(ops.__name__, False)) / "lock"
    lock.touch()  # what a killed build leaves
    try:
        run = subprocess.run([sys.executable, "-c", "from pagedllm.kernels import cpu_ops; assert cpu_ops() is not None"],
                             capture_output=True, text=True, timeout=300)
    finally:
        stale = lock.exists()
        lock.unlink(missing_ok=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert not stale
    assert "left by a kernel build that was interrupted" in run.stderr


def test_a_built_module_loads_without_the_extension_loader(ops, tmp_path, monkeypatch):
    """A start whose kernels are built imports the module from torch's extensions folder itself: not
    ``torch.utils.cpp_extension``, whose setuptools import cost 0.65 s of every start. The folder is the one torch's
    loader builds in, with and without ``TORCH_EXTENSIONS_DIR``."""
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory

    from pagedllm.kernels import extensions_dir

    assert extensions_dir(ops.__name__) == Path(_get_build_directory(ops.__name__, False))
    with monkeypatch.context() as m:  # (the x86-level runs set their own: kept for the process below)
        m.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
        assert extensions_dir("m") == Path(_get_build_directory("m", False)) == tmp_path / "m"
    run = subprocess.run([sys.executable, "-c", "import sys; from pagedllm.kernels import cpu_ops; "
                          "print(cpu_ops().__name__, 'setuptools' in sys.modules, 'torch.utils.cpp_extension' in "
                          "sys.modules)"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.split() == [ops.__name__, "False", "False"], run.stdout + run.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_tiled", [False, True])
def test_gated_delta_rows_match_the_layers_torch_path(ops, dtype, v_tiled):
    """Gated DeltaNet's fused step (deltanet.cpp: conv, recurrence row by row, gated norm, states in place) against
    the layer's torch path (the chunked rule) on one step of mixed sequences: two decode rows, a 90-row prefill
    that saves a snapshot after 70 rows, a 5-row one starting from a zero state. Outputs, the updated states and
    the snapshot agree."""
    from pagedllm.layers.gated_deltanet import GatedDeltaNet, StateMetadata, StatePrefill

    torch.manual_seed(3)
    nk, nv, dk, dv, k = 2, 4, 32, 32, 4
    c = 2 * nk * dk + nv * dv
    hidden = 48
    w_in = torch.randn(c + nv * dv + 2 * nv, hidden) * 0.2
    w_out = torch.randn(hidden, nv * dv) * 0.1
    layer = GatedDeltaNet(lambda x: x @ w_in.to(x.dtype).T, lambda y: y.float() @ w_out.T,
                          (torch.randn(c, k) * 0.5).to(dtype), -torch.rand(nv) * 3 - 0.5, torch.randn(nv) * 0.3,
                          (1 + torch.randn(dv) * 0.1).to(dtype), nk, nv, dk, dv, v_tiled, 1e-6)
    slots = 8
    conv0 = (torch.randn(slots, c, k - 1) * 0.5).to(dtype)
    rec0 = torch.randn(slots, nv, dk, dv) * 0.1
    rec0[5], conv0[5] = 0, 0  # the 5-row prefill starts a sequence
    x = torch.randn(97, hidden).to(dtype)
    # rows: decode (slot 1), prefill 90 rows (slot 2, snapshot after 70 into slot 6), decode (slot 3), 5 rows (slot 5)
    prefills = [StatePrefill(1, 91, 2, 70, 6), StatePrefill(92, 97, 5)]
    meta = StateMetadata(torch.tensor([0, 91]), torch.tensor([1, 3]), 2, prefills,
                         torch.tensor([[0, 1, 1, 0, -1], [91, 1, 3, 0, -1], [1, 90, 2, 70, 6], [92, 5, 5, 0, -1]]))
    outs, pools = [], []
    for fused in (True, False):
        conv, rec = conv0.clone(), rec0.clone()
        run_ops = TorchOps()
        if fused:
            run_ops = type("Fused", (), {"fused": True, "kernels": ops})()
        outs.append(layer(x, None, None, (conv, rec), meta, run_ops))
        pools.append((conv, rec))
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    err = ((outs[0] - outs[1]).abs().max() / outs[1].abs().max()).item()
    assert err < tol, err
    for s in (1, 2, 3, 5, 6):
        assert torch.equal(pools[0][0][s], pools[1][0][s]), s  # the convolution's inputs: copies of the rows
        err = ((pools[0][1][s] - pools[1][1][s]).abs().max() / pools[1][1][s].abs().max()).item()
        assert err < tol, (s, err)
    assert torch.equal(pools[0][1][0], rec0[0]) and torch.equal(pools[0][1][7], rec0[7])  # other slots untouched
