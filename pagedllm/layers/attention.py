"""Paged attention: K/V live in fixed-size blocks; each sequence reads its context through its block table.

Two paths, chosen per sequence by the model runner:
- decode (one query token): all such sequences in one batched computation; on CPU with the fused kernels
  (``pagedllm.kernels``) each sequence's K/V blocks are read in place through its block table, otherwise the
  context is gathered and handed to PyTorch's fused SDPA;
- prefill / chunked prefill (several query tokens, maybe after cached or earlier-computed context): exact tiled
  attention with an online softmax (FlashAttention, Dao et al. 2022) that never builds the N x N score matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.quant.formats import reorder_rows

Q_TILE = 256
K_TILE = 512


@dataclass
class PrefillSeq:
    start: int  # first query row in the flat batch
    end: int  # one past the last query row
    context_len: int  # tokens of context after this chunk (cached + earlier chunks + this chunk)
    block_table: torch.Tensor  # (num_blocks_needed,) long


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) long: where each new token's K/V is written in the flat cache
    # decode sequences
    decode_rows: torch.Tensor | None  # (Bd,) rows of the flat batch; None when every row is a decode
    decode_block_tables: torch.Tensor | None  # (Bd, max_blocks) long, padded
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, max_blocks * block_size) bool: True where a key is valid
    num_decodes: int = 0
    decode_lens: torch.Tensor | None = None  # (Bd,) long: context length of each decode (its new token included)
    prefills: list[PrefillSeq] = field(default_factory=list)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """k_cache: (num_blocks, block_size, Hkv, D); k: (T, Hkv, D), rounded to the cache's dtype."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slots, v.to(v_cache.dtype))


def tiled_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int, scale: float,
    q_tile: int = Q_TILE, k_tile: int = K_TILE, window: int = 0, softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact causal attention of ``n`` queries at positions q_offset.. over ``L`` keys at positions 0..L-1
    (``window`` > 0: a query at p sees only the keys p - window + 1 .. p, a sliding-window layer; ``softcap`` > 0:
    scores soft-capped to softcap * tanh(score / softcap) before the softmax, gemma 2; ``sinks``: a float32 logit
    per query head in each softmax's denominator with no value behind it, gpt-oss's attention sinks).

    q: (n, Hq, D); k, v: (L, Hkv, D), Hq a multiple of Hkv (grouped-query attention). Returns (n, Hq, D).
    Scores exist only one (q_tile x k_tile) tile at a time; accumulation is in float32.
    """
    n, hq, d = q.shape
    seq_len, hkv, _ = k.shape
    g = hq // hkv
    out = torch.empty_like(q)
    kh = k.permute(1, 0, 2)  # (Hkv, L, D)
    vh = v.permute(1, 0, 2)
    acc_dtype = torch.float32
    for qs in range(0, n, q_tile):
        qe = min(qs + q_tile, n)
        m = qe - qs
        # (Hkv, G*m, D): the G query heads of a KV head, stacked with their rows
        qt = q[qs:qe].view(m, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * m, d).to(acc_dtype) * scale
        q_pos = (torch.arange(qs, qe, device=q.device) + q_offset).repeat(g)  # (G*m,)
        if sinks is None:
            row_max = torch.full((hkv, g * m, 1), float("-inf"), dtype=acc_dtype, device=q.device)
            row_sum = torch.zeros((hkv, g * m, 1), dtype=acc_dtype, device=q.device)
        else:  # the online softmax starts from the sink: its logit is the first max, exp(0) = 1 the first sum
            row_max = sinks.to(acc_dtype).view(hkv, g, 1, 1).expand(hkv, g, m, 1).reshape(hkv, g * m, 1)
            row_sum = torch.ones((hkv, g * m, 1), dtype=acc_dtype, device=q.device)
        acc = torch.zeros((hkv, g * m, d), dtype=acc_dtype, device=q.device)
        last_key = min(seq_len, q_offset + qe)  # keys past the tile's last query position are never needed
        first_masked = q_offset + qs  # keys at or past this position need the causal mask
        # the window: keys before the first query's window are never needed; those before the last one's masked
        first_key = max(0, q_offset + qs - window + 1) if window else 0
        for ks in range(first_key - first_key % k_tile, last_key, k_tile):
            ke = min(ks + k_tile, last_key)
            s = torch.matmul(qt, kh[:, ks:ke].to(acc_dtype).transpose(1, 2))  # (Hkv, G*m, kt)
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            if ke - 1 > first_masked or (window and ks <= q_offset + qe - 1 - window):
                k_pos = torch.arange(ks, ke, device=q.device)
                outside = k_pos[None, :] > q_pos[:, None]
                if window:
                    outside |= k_pos[None, :] <= q_pos[:, None] - window
                s.masked_fill_(outside, float("-inf"))
            new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
            shift = new_max
            if window:  # a row may have seen no key yet (all outside its window): exp(-inf - -inf) would be NaN
                shift = new_max.masked_fill(new_max == float("-inf"), 0.0)
            p = torch.exp(s - shift)
            alpha = torch.exp(row_max - shift)
            row_sum = row_sum * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, vh[:, ks:ke].to(acc_dtype))
            row_max = new_max
        res = (acc / row_sum).view(hkv, g, m, d).permute(2, 0, 1, 3).reshape(m, hq, d)
        out[qs:qe] = res.to(q.dtype)
    return out


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence over its paged context. q: (B, Hq, D) -> (B, Hq, D).

    The torch path (CUDA, or a CPU without the fused kernels): the context is gathered block-wise (one index op
    per cache) and handed as a strided view to PyTorch's fused scaled_dot_product_attention (grouped-query aware),
    which is faster than a plain matmul/softmax/matmul over the gathered blocks (figures in docs/history.md).
    """
    b, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    flat = block_tables.view(-1)  # index_select copies whole blocks, faster than advanced indexing
    k = k_cache.index_select(0, flat).to(q.dtype).view(b, -1, hkv, d).transpose(1, 2)  # (B, Hkv, L, D), strided
    v = v_cache.index_select(0, flat).to(q.dtype).view(b, -1, hkv, d).transpose(1, 2)
    if softcap or sinks is not None:  # SDPA has neither soft-capping nor sinks: the scores by hand
        g, ct = hq // hkv, torch.promote_types(q.dtype, torch.float32)  # at least float32 (float64 stays)
        s = torch.matmul(q.view(b, hkv, g, d).to(ct) * scale, k.to(ct).transpose(-1, -2))  # (B, Hkv, G, L)
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
        if sinks is not None:  # a last column of the sink logits, dropped after the softmax
            s = torch.cat([s, sinks.to(ct).view(1, hkv, g, 1).expand(b, hkv, g, 1)], dim=-1)
            return torch.matmul(torch.softmax(s, dim=-1)[..., :-1], v.to(ct)).view(b, hq, d).to(q.dtype)
        return torch.matmul(torch.softmax(s, dim=-1), v.to(ct)).view(b, hq, d).to(q.dtype)
    out = F.scaled_dot_product_attention(q.view(b, hq, 1, d), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.view(b, hq, d)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, ops=None,
    window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (T, Hq, D); k, v: (T, Hkv, D) for the step's new tokens, written to the cache first (None: already
    written, e.g. by the fused rotary kernel). ``ops``: the fused CPU kernels, or None for torch operations.
    ``window`` > 0: each query sees only its last ``window`` keys (its own included); ``softcap`` > 0: scores
    soft-capped (gemma 2); ``sinks``: (Hq,) float32 sink logits (gpt-oss)."""
    if k is not None:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)

    def decode(qd: torch.Tensor) -> torch.Tensor:
        if ops is not None:
            return ops.decode_attention(qd, k_cache, v_cache, meta.decode_block_tables, meta.decode_lens, scale,
                                        window, softcap, sinks)
        mask = meta.decode_mask
        if window:  # keys before len - window are outside
            pos = torch.arange(mask.shape[-1], device=mask.device)
            mask = mask & (pos >= meta.decode_lens.view(-1, 1, 1, 1) - window)
        return decode_attention(qd, k_cache, v_cache, meta.decode_block_tables, mask, scale, softcap, sinks)

    if meta.num_decodes and meta.decode_rows is None:  # all rows are decodes
        return decode(q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.num_decodes:
        rows = meta.decode_rows
        out[rows] = decode(q[rows])
    nb, bs, hkv, d = k_cache.shape
    for p in meta.prefills:
        kc = k_cache.index_select(0, p.block_table).view(-1, hkv, d)[: p.context_len]
        vc = v_cache.index_select(0, p.block_table).view(-1, hkv, d)[: p.context_len]
        out[p.start : p.end] = tiled_causal_attention(
            q[p.start : p.end], kc, vc, q_offset=p.context_len - (p.end - p.start), scale=scale, window=window,
            softcap=softcap, sinks=sinks)
    return out


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]],
                            scale: float, radius: int = 0) -> torch.Tensor:
    """An encoder's attention: the rows of each span (one text of the flat batch) attend to every row of their
    span (``radius`` > 0: only to rows at most ``radius`` away, EmbeddingGemma's sliding layers). q: (T, Hq, D);
    k, v: (T, Hkv, D), Hq a multiple of Hkv. Returns (T, Hq, D). Nothing is cached: the whole text is here."""
    out = torch.empty_like(q)
    acc = torch.promote_types(q.dtype, torch.float32)  # float32 at least: on CPU also the faster (head dim 32: ~1.4x)
    for s, e in spans:
        n = e - s
        mask = None
        if radius and n > radius + 1:
            pos = torch.arange(n, device=q.device)
            mask = (pos[:, None] - pos[None, :]).abs() <= radius
        qh, kh, vh = (x[s:e].transpose(0, 1).unsqueeze(0).to(acc) for x in (q, k, v))  # (1, H, n, D)
        y = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = y[0].transpose(0, 1)
    return out


class QueryTemperature:
    """Llama 4's attention temperature (Ministral 3): a query at position p times 1 + scale * log(1 + floor(p /
    length)), as transformers computes it in float32. One instance serves every layer: the factors are computed
    once per step (for the step's positions tensor)."""

    def __init__(self, scale: float, length: int) -> None:
        self.scale, self.length = scale, length
        self._positions = self._factors = None

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        if positions is not self._positions:
            self._positions = positions
            self._factors = 1 + self.scale * torch.log(1 + torch.floor(positions / self.length))
        return self._factors


class Attention:
    """A layer's self-attention: the fused q/k/v projection, QK-norm (optional), the rotary, attention over the
    paged KV cache (causal, within the layer's window, scores soft-capped where the model does) or, in an encoder,
    over each whole text (``causal`` False: nothing cached), and the output projection. ``num_heads`` /
    ``num_kv_heads``: this rank's heads (all of them without tensor parallelism); the output projection's partial
    sums are reduced by the caller. ``rotary`` None (an encoder only): no rotary, the positions being in the
    embeddings (BERT)."""

    # how its weights split over tensor-parallel ranks (``distributed.sharding``): q/k/v rows (and biases) by head
    # (column-parallel), o's columns by query head (row-parallel: partial sums, reduced after it; its bias added by
    # rank 0 alone), the sinks by query head
    TP_SPLIT = {"q": ("rows", "heads"), "q_bias": ("rows", "heads"), "k": ("rows", "kv_heads"),
                "k_bias": ("rows", "kv_heads"), "v": ("rows", "kv_heads"), "v_bias": ("rows", "kv_heads"),
                "o": ("cols", "heads"), "o_bias": ("first", ""), "sinks": ("rows", "head_values")}

    def __init__(self, qkv, o, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 rotary: RotaryEmbedding, window: int = 0, softcap: float = 0.0, q_norm: torch.Tensor | None = None,
                 k_norm: torch.Tensor | None = None, eps: float = 1e-6, causal: bool = True,
                 temperature: "QueryTemperature | None" = None, sinks: torch.Tensor | None = None,
                 output_gate: bool = False, v_norm: torch.Tensor | None = None, kv_shared: bool = False) -> None:
        """``temperature``: each query times its position's factor after the rotary (Ministral 3); ``sinks``:
        (num_heads,) float32 logits, one per query head, in each softmax's denominator (gpt-oss); ``output_gate``:
        the projection's first num_heads * head_dim columns are a gate, the output times its sigmoid before ``o``
        (Qwen 3.5; ``load_projections(gated=True)`` puts them there); ``v_norm``: each v head RMS-normalised
        (times these weights: ones for Gemma 4's weightless norm); ``kv_shared``: the projection is q alone and the
        layer attends over the K/V another layer wrote to ``kv`` (Gemma 4's last layers)."""
        self.qkv, self.o = qkv, o
        self.v_norm, self.kv_shared = v_norm, kv_shared
        self.output_gate = output_gate
        self.temperature = temperature
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale, self.rotary, self.window, self.softcap = scale, rotary, window, softcap
        self.q_norm, self.k_norm, self.eps, self.causal = q_norm, k_norm, eps, causal
        self.sinks = sinks

    @staticmethod
    def load_projections(src, prefix: str, bias: bool, gated: bool = False, head_dim: int = 0, kv: str = "own",
                         dense: bool = True):
        """(qkv, o) from ``{prefix}qkv`` (or ``q``, ``k``, ``v`` fused here; their biases with ``bias``) and
        ``{prefix}o`` (its bias ``o_bias`` where the checkpoint has one: gpt-oss). ``gated``: ``q`` holds each head's
        query rows then its gate rows (Qwen 3.5); the fused projection is then [gates, q, k, v], so that q/k/v
        stay adjacent columns for the kernels. ``kv``: "shared" (q alone: the layer reads another's K/V; any k/v
        weights the checkpoint keeps for it are dropped), or "own" (where a layer has no ``v`` its values are its
        keys' projection, Gemma 4's ``attention_k_eq_v``: k's rows serve twice). ``dense``: the linears may keep a
        dense copy for large steps (``WeightSource.linear``)."""
        if kv == "shared":
            for name in ("k", "v", "k_norm", "v_norm"):
                src.weights.pop(prefix + name, None)
            return src.linear(prefix + "q", [prefix + "q"], "attn"), src.linear(prefix + "o", [prefix + "o"], "attn")
        if prefix + "qkv" not in src and prefix + "v" not in src:
            src.weights[prefix + "v"] = src.weights[prefix + "k"]
        if gated:
            w = src.pop(prefix + "q")
            heads = (w.shape[0] if isinstance(w, torch.Tensor) else w.codes.shape[0]) // (2 * head_dim)
            idx = torch.arange(heads * 2 * head_dim).view(heads, 2, head_dim)
            perm = torch.cat([idx[:, 1].reshape(-1), idx[:, 0].reshape(-1)])  # gate rows first, then q rows
            src.weights[prefix + "q"] = w[perm] if isinstance(w, torch.Tensor) else reorder_rows(w, lambda x: x[perm])
        b = None
        if bias:
            b = src.pop(prefix + "qkv_bias") if prefix + "qkv_bias" in src else torch.cat(
                [src.pop(prefix + "q_bias"), src.pop(prefix + "k_bias"), src.pop(prefix + "v_bias")])
        qkv = src.linear(prefix + "qkv", [prefix + "q", prefix + "k", prefix + "v"], "attn", b, dense)  # (Q+2K, H)
        o_bias = src.pop(prefix + "o_bias") if prefix + "o_bias" in src else None
        return qkv, src.linear(prefix + "o", [prefix + "o"], "attn", o_bias, dense)

    def linear_slots(self, prefix: str):
        yield prefix + "qkv", self, "qkv"
        yield prefix + "o", self, "o"

    def norms(self) -> dict[str, torch.Tensor]:
        """Its small float tensors besides the linears: the QK-norms, the sinks."""
        out = {} if self.q_norm is None else {"q_norm": self.q_norm, "k_norm": self.k_norm}
        return out if self.sinks is None else out | {"sinks": self.sinks}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rot, kv: tuple, meta, ops) -> torch.Tensor:
        """x: (T, H) normalised rows -> (T, H) (before any reduction over ranks). ``rot``: the step's rotary
        (``ops.step_rotary``); ``kv``: the layer's (K, V) caches, or (None, None) in an encoder, whose ``meta``
        is the step's spans (one per text)."""
        t, nq, nkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)  # (T, Q+2K), or (T, Q+Q+2K) with the gates first
        if self.rotary is not None or self.q_norm is not None:  # normalised and rotated in the activations' dtype
            want = ops.qkv_dtype if ops.qkv_dtype is not None else x.dtype  # (an encoder's bfloat16 linears: float32)
            if qkv.dtype != want:
                qkv = qkv.to(want)
        gate = None
        if self.output_gate:
            gate, qkv = qkv[:, : self.q_size], qkv[:, self.q_size:]  # views: the kernels take the row stride
        own = 0 if self.kv_shared else nkv  # the K/V heads this layer computes and writes
        if self.q_norm is not None:  # each q and k head normalised in place, before the rotary
            ops.qk_norm(qkv, self.q_norm, self.k_norm if own else self.q_norm, nq, own, self.eps)
        if self.v_norm is not None and own:
            ops.qk_norm(qkv[:, (nq + nkv) * d:], self.v_norm, self.v_norm, nkv, 0, self.eps)
        k_cache, v_cache = kv
        if self.rotary is not None:  # (none: an encoder with absolute positions in its embeddings, BERT)
            ops.rope_write_kv(qkv, positions, rot[0], rot[1], meta.slot_mapping if self.causal else None, k_cache,
                              v_cache, nq, own)
        q = qkv[:, : self.q_size].view(t, nq, d)  # rotated in place
        if self.temperature is not None:
            q.mul_(self.temperature(positions).to(q.dtype).view(t, 1, 1))
        if self.causal:
            attn = paged_attention(q, None, None, k_cache, v_cache, meta, self.scale, ops.kernels,
                                   window=self.window, softcap=self.softcap, sinks=self.sinks)  # (T, Hq, D)
        else:  # transformers' bidirectional sliding layers: |query - key| < window // 2 + 1
            k = qkv[:, self.q_size: self.q_size + self.kv_size].view(t, nkv, d)
            v = qkv[:, self.q_size + self.kv_size:].view(t, nkv, d)
            attn = ops.bidirectional_attention(q, k, v, meta, self.scale, self.window // 2)
        attn = attn.reshape(t, self.q_size)
        if gate is not None:
            attn = attn * torch.sigmoid(gate)
        return self.o(attn)

    __call__ = forward
