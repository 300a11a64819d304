"""The fused CPU kernels (pagedllm/kernels/cpu_ops.cpp) against the torch operations they replace.

The kernels must build here: this machine (and CI) has a C++ compiler, and the engine's CPU speed depends on them.
"""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_ops
from pagedllm.layers.attention import decode_attention, write_kv
from pagedllm.layers.linear import DenseLinear
from pagedllm.layers.norm import rms_norm
from pagedllm.layers.rotary import RotaryEmbedding

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
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (14, 2, 128), (8, 2, 32), (9, 1, 64)])
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
    with pytest.raises(RuntimeError, match="dtype"):
        ops.decode_attention(q.bfloat16(), kc, vc, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="outside the cache"):  # a bad block id is refused, not read
        ops.decode_attention(q, kc, vc, torch.tensor([[3, 8], [0, 5]]), lens, 0.125)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(ops, dtype):
    torch.manual_seed(3)
    gu = torch.randn(3, 2 * 40, dtype=dtype) * 4  # 40: two vector chunks of 16 and a scalar tail
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0], dtype=dtype)
    g, u = gu.float().chunk(2, dim=-1)
    _close(ops.silu_and_mul(gu), (F.silu(g) * u).to(dtype), dtype)


def test_prepacked_bf16_linear_matches_f_linear():
    torch.manual_seed(4)
    w, b = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    lin = DenseLinear(w.clone(), b).prepack(keep_weight=False)
    if torch.backends.mkldnn.is_available():
        assert lin.packed is not None and lin.weight is None
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
    llm = LLM()
    assert llm.engine.core.runner.model.ops is not None
    alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    batch = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    assert batch == alone


def test_fused_and_torch_paths_agree():
    """The torch path (CUDA, or no compiler) and the fused CPU path give the same greedy tokens and close
    logprobs on the engine's own steps: prefill, decode, and both mixed in one step."""
    from conftest import PROMPTS
    from pagedllm import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1)
    llm = LLM(enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    fused = llm.generate(PROMPTS, sp, use_tqdm=False)
    ops, model.ops = model.ops, None
    try:
        plain = llm.generate(PROMPTS, sp, use_tqdm=False)
    finally:
        model.ops = ops
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(la.logprob - lb.logprob) < 1e-3
