"""Attention, sampler and detokenizer units against straightforward references."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagedllm.layers.attention import AttentionMetadata, PrefillSeq, paged_attention, tiled_causal_attention


def naive_attention(q, k, v, q_offset, window=0, sinks=None):
    """Softmax attention in float64 (``sinks``: a column of per-head logits joins each softmax, then is dropped, as
    transformers' gpt-oss computes it)."""
    n, hq, d = q.shape
    L, hkv, _ = k.shape
    g = hq // hkv
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) / d**0.5
    qpos = torch.arange(n)[:, None] + q_offset
    s = s.masked_fill(torch.arange(L)[None, :] > qpos, float("-inf"))
    if window:
        s = s.masked_fill(torch.arange(L)[None, :] <= qpos - window, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(hq, 1, 1).expand(hq, n, 1)], dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("hnl,lhd->nhd", s, v.double()).float()
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v.double()).float()


@pytest.mark.parametrize("n, offset, q_tile, k_tile", [(1, 0, 4, 4), (37, 0, 8, 16), (37, 50, 8, 16),
                                                        (100, 3, 256, 512), (64, 64, 16, 8)])
def test_tiled_attention_matches_reference(n, offset, q_tile, k_tile):
    torch.manual_seed(0)
    q = torch.randn(n, 9, 64)
    k = torch.randn(n + offset, 3, 64)
    v = torch.randn(n + offset, 3, 64)
    out = tiled_causal_attention(q, k, v, offset, 64**-0.5, q_tile=q_tile, k_tile=k_tile)
    torch.testing.assert_close(out, naive_attention(q, k, v, offset), atol=2e-5, rtol=1e-4)
    for window in (1, 5, 17, 40):  # sliding-window layers: key tiles before every query's window skipped
        out = tiled_causal_attention(q, k, v, offset, 64**-0.5, q_tile=q_tile, k_tile=k_tile, window=window)
        torch.testing.assert_close(out, naive_attention(q, k, v, offset, window), atol=2e-5, rtol=1e-4)
    sinks = torch.randn(9) * 2 + 1  # gpt-oss: a logit per query head in each softmax, with and without a window
    for window in (0, 5):
        out = tiled_causal_attention(q, k, v, offset, 64**-0.5, q_tile=q_tile, k_tile=k_tile, window=window,
                                     sinks=sinks)
        want = naive_attention(q, k, v, offset, window, sinks)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
        assert not torch.allclose(want, naive_attention(q, k, v, offset, window), atol=1e-3)


class MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_long_prefill_never_materializes_n_by_n_scores():
    n, hq, hkv, d = 2048, 9, 3, 64
    q, k, v = torch.randn(n, hq, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    with MaxNumel() as m:
        tiled_causal_attention(q, k, v, 0, d**-0.5)
    # the largest tensor is a tile of scores or the inputs themselves, far from H x N x N
    assert m.largest < hq * n * n // 8, m.largest
    assert m.largest <= max(hq * 256 * 512, n * hq * d)


def test_paged_attention_mixed_decode_and_prefill():
    """Scattered blocks, one decode row and one chunked-prefill sequence, against contiguous attention."""
    torch.manual_seed(1)
    bs, hkv, hq, d = 4, 2, 4, 8
    k_cache = torch.zeros(16, bs, hkv, d)
    v_cache = torch.zeros(16, bs, hkv, d)
    # sequence A: 9 tokens of context already cached in blocks [7, 2, 11]; decodes token 10 (position 9)
    # sequence B: 6 cached tokens in blocks [5, 0]; computes a chunk of 5 tokens (positions 6..10) -> block 9
    ka, va = torch.randn(10, hkv, d), torch.randn(10, hkv, d)
    kb, vb = torch.randn(11, hkv, d), torch.randn(11, hkv, d)
    ta, tb = [7, 2, 11], [5, 0, 9]
    for tbl, kk, vv, n in ((ta, ka, va, 9), (tb, kb, vb, 6)):
        for p in range(n):
            k_cache[tbl[p // bs], p % bs] = kk[p]
            v_cache[tbl[p // bs], p % bs] = vv[p]
    q = torch.randn(6, hq, d)  # row 0: A's decode; rows 1..5: B's chunk
    k_new = torch.cat([ka[9:10], kb[6:11]])
    v_new = torch.cat([va[9:10], vb[6:11]])
    slots = [ta[9 // bs] * bs + 9 % bs] + [tb[p // bs] * bs + p % bs for p in range(6, 11)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        decode_rows=torch.tensor([0]),
        decode_block_tables=torch.tensor([ta]),
        decode_mask=(torch.arange(12) < 10)[None, None, None, :],
        num_decodes=1,
        prefills=[PrefillSeq(1, 6, 11, torch.tensor(tb))],
    )
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, d**-0.5)
    torch.testing.assert_close(out[0:1], naive_attention(q[0:1], ka, va, 9), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[1:6], naive_attention(q[1:6], kb, vb, 6), atol=1e-5, rtol=1e-4)


def test_penalties_match_naive_loop():
    from pagedllm.sample.sampler import SamplingMetadata, apply_penalties

    torch.manual_seed(2)
    V = 50
    logits = torch.randn(2, V)
    outs = [[3, 3, 7], [1]]
    prompts = [[9, 3], [2, 2, 4]]
    rep, pres, freq = [1.5, 0.8], [0.5, 0.0], [0.3, 1.0]
    m = SamplingMetadata(
        temperature=torch.ones(2), greedy=torch.zeros(2, dtype=torch.bool), all_greedy=False, top_k=None,
        top_p=None, min_p=None, generators={}, repetition_penalty=torch.tensor(rep),
        presence_penalty=torch.tensor(pres), frequency_penalty=torch.tensor(freq),
        output_tokens=torch.tensor([[3, 3, 7], [1, V, V]]), prompt_tokens=torch.tensor([[9, 3, V], [2, 2, 4]]),
        logit_bias=None, banned=None, max_num_logprobs=None,
    )
    got = apply_penalties(logits.clone(), m)
    want = logits.clone()
    for r in range(2):
        for t in set(outs[r]) | set(prompts[r]):
            want[r, t] = want[r, t] / rep[r] if want[r, t] > 0 else want[r, t] * rep[r]
        for t in set(outs[r]):
            want[r, t] -= freq[r] * outs[r].count(t) + pres[r]
    torch.testing.assert_close(got, want)


def test_top_p_top_k_min_p_filtering():
    from pagedllm.sample.sampler import SamplingMetadata, apply_top_k_top_p_min_p

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.4, 0.3, 0.2, 0.1]]))

    def meta(**kw):
        base = dict(temperature=torch.ones(2), greedy=torch.zeros(2, dtype=torch.bool), all_greedy=False,
                    top_k=None, top_p=None, min_p=None, generators={}, repetition_penalty=None,
                    presence_penalty=None, frequency_penalty=None, output_tokens=None, prompt_tokens=None,
                    logit_bias=None, banned=None, max_num_logprobs=None)
        base.update(kw)
        return SamplingMetadata(**base)

    kept = lambda x: torch.isfinite(x).tolist()
    assert kept(apply_top_k_top_p_min_p(logits, meta(top_k=torch.tensor([2, 4])))) == [
        [True, True, False, False], [True, True, True, True]]
    assert kept(apply_top_k_top_p_min_p(logits, meta(top_p=torch.tensor([0.8, 0.5])))) == [
        [True, True, False, False], [True, True, False, False]]
    assert kept(apply_top_k_top_p_min_p(logits, meta(min_p=torch.tensor([0.5, 0.45])))) == [
        [True, True, False, False], [True, True, True, False]]


def test_incremental_detokenizer_multibyte(llm):
    from pagedllm.engine.detokenizer import IncrementalDetokenizer

    tok = llm.engine.tokenizer
    for text in ["Héllo wörld — naïve café 日本語のテキスト 🎉🚀 done", "  leading spaces\n\tand\ttabs", "ümlaut"]:
        ids = tok.encode(text)
        prompt = tok.encode("Say:")
        detok = IncrementalDetokenizer(tok, prompt)
        pieces = [detok.add_token(t) for t in ids]
        assert "".join(pieces) == tok.decode(ids) == detok.text
        assert all("\ufffd" not in p for p in pieces)
