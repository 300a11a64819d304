"""Gated DeltaNet (Yang et al. 2024), the linear-attention layers of Qwen 3.5 and Qwen3-Next: a fixed-size state per
sequence instead of a KV cache.

Per layer and sequence the state is the short convolution's last ``K - 1`` inputs (conv_dim channels, the model's
dtype) and a (value heads, key dim, value dim) float32 matrix ``S``. Each token: one projection gives the mixed
q/k/v (through a causal depthwise convolution and SiLU), the output gate z, beta (sigmoid) and the decay
g = A * softplus(a + dt_bias) (A < 0); q and k are L2-normalised (q also scaled by 1/sqrt(key dim)); then
S = exp(g) S; S += k (beta (v - S^T k))^T; out = S^T q; out is RMS-normalised, times the norm weight, times SiLU(z),
and projected back. A prefill chunk runs the chunked form (the WY / UT transform over chunks of 64 tokens, as
transformers' reference and FLA compute it); decode rows run the recurrence, batched over sequences.

The states live in the worker's pools (``worker.kv_cache``): ``slot`` rows of (slots, conv_dim, K - 1) and (slots,
Hv, Dk, Dv) tensors; ``StateMetadata`` says which slot each sequence of the step reads and writes, and where a
prefill chunk saves a copy of its state at a block boundary (a prefix-cache snapshot)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.quant.formats import reorder_rows

CHUNK = 64  # the chunked form's chunk length (transformers' and FLA's)


@dataclass
class StatePrefill:
    start: int  # first row in the flat batch
    end: int  # one past the last row
    slot: int  # the sequence's state slot
    save_rows: int = 0  # > 0: after this many rows of the chunk, copy the state to ``save_slot`` (a snapshot)
    save_slot: int = -1


@dataclass
class StateMetadata:
    decode_rows: torch.Tensor | None  # (Bd,) rows of one-token sequences; None when every row is one, in order
    decode_slots: torch.Tensor | None  # (Bd,) long: their slots
    num_decodes: int = 0
    prefills: list[StatePrefill] = field(default_factory=list)
    # every sequence (decode rows and prefill chunks), for the fused kernel: (B, 5) long rows of [first row, rows,
    # slot, snapshot after this many rows (0: none), snapshot slot]
    seqs: torch.Tensor | None = None
    # speculative decoding: the model keeps each state layer's input rows ``keep_rows`` in ``kept`` (layer -> rows),
    # from which the rows of accepted tokens are computed again after a rejection (``CausalLM.replay_states``)
    keep_rows: torch.Tensor | None = None
    kept: dict | None = None


def decode_conv(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One input row per sequence (B, C) through the causal depthwise convolution ``w`` (C, K) over each slot's last
    K - 1 inputs (the slots' histories shifted in ``pool``) -> (B, C) in ``w``'s dtype, before any activation."""
    window = torch.cat([pool[slots], x.unsqueeze(-1).to(pool.dtype)], dim=-1)  # (B, C, K)
    pool[slots] = window[:, :, 1:]
    return (window.to(w.dtype) * w).sum(dim=-1)


def prefill_conv(pool: torch.Tensor, p: StatePrefill, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A chunk's rows (n, C) through the convolution over its slot's history -> (n, C) in ``w``'s dtype; the slot's
    history becomes the chunk's last K - 1 inputs, and a snapshot's (``p.save_rows`` > 0) those after that row."""
    n, km1 = x.shape[0], w.shape[1] - 1
    seq = torch.cat([pool[p.slot], x.t().to(pool.dtype)], dim=-1)  # (C, K-1+n)
    y = F.conv1d(seq.unsqueeze(0).to(w.dtype), w.unsqueeze(1), groups=w.shape[0])[0].t()
    pool[p.slot] = seq[:, n:]
    if p.save_rows:
        pool[p.save_slot] = seq[:, p.save_rows:p.save_rows + km1]
    return y


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (transformers' and FLA's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, pieces: list[list[tuple[int, int]]], chunk: int = CHUNK,
                     saves: dict[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """B sequences' rows through the gated delta rule in chunks, batched over the sequences. q, k: (n, H, Dk) float32
    (normalised, q scaled); v: (n, H, Dv); g, beta: (n, H); ``state``: (B, H, Dk, Dv) float32, each sequence's state
    before its first row; ``pieces[b]``: sequence b's rows as consecutive [start, end) ranges of the n rows, each
    padded to whole chunks (a piece ends where a snapshot is taken: ``saves[b]`` = the index of the piece after
    which sequence b's state is returned). Padded rows have k = v = beta = g = 0: they leave a state unchanged, as
    transformers' padding does. Returns (out (n, H, Dv), the states after the last rows, {b: snapshot state})."""
    n, h, dk = k.shape
    dv = v.shape[-1]
    dev = q.device
    chunks = [[(lo + i, min(lo + i + chunk, hi)) for lo, hi in ps for i in range(0, hi - lo, chunk)] for ps in pieces]
    nc = max(len(c) for c in chunks)
    bsz = len(pieces)
    # where each real row sits in the padded (B, nc * chunk) layout
    dst = torch.tensor([(b * nc + j) * chunk + r - lo for b, cs in enumerate(chunks) for j, (lo, hi) in enumerate(cs)
                        for r in range(lo, hi)], dtype=torch.long, device=dev)
    src = torch.tensor([r for cs in chunks for lo, hi in cs for r in range(lo, hi)], dtype=torch.long, device=dev)

    def padded(x: torch.Tensor) -> torch.Tensor:  # (n, H, ...) -> (nc, B, H, chunk, ...), contiguous
        out = x.new_zeros((bsz * nc * chunk, *x.shape[1:]))
        out[dst] = x[src]
        out = out.view(bsz, nc, chunk, *x.shape[1:])
        perm = (1, 0, 3, 2, 4) if x.dim() == 3 else (1, 0, 3, 2)
        return out.permute(*perm).contiguous()

    q, k, v, beta, g = padded(q), padded(k), padded(v), padded(beta), padded(g)
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    cum = g.cumsum(dim=-1)  # (nc, B, H, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill_(upper, float("-inf")).exp_()
    kt = k.transpose(-1, -2)
    ut = (k_beta @ kt).mul_(decay)
    intra = (q @ kt).mul_(decay)
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    ecum = cum.exp()
    k_cum = torch.linalg.solve_triangular(ut, k_beta * ecum.unsqueeze(-1), upper=False, unitriangular=True)
    q = q * ecum.unsqueeze(-1)
    k = (k * (cum[..., -1:] - cum).exp().unsqueeze(-1)).transpose(-1, -2).contiguous()  # (nc, B, H, Dk, chunk)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # (nc, B, H, 1, 1)
    out = torch.empty_like(new_v)
    ends = {b: sum(-(-(hi - lo) // chunk) for lo, hi in pieces[b][:i + 1]) - 1 for b, i in (saves or {}).items()}
    snaps = {}
    st = state.contiguous()
    for i in range(nc):
        v_new = torch.sub(new_v[i], k_cum[i] @ st)
        torch.matmul(q[i], st, out=out[i])
        out[i].add_(intra[i] @ v_new)
        st = torch.addcmul(k[i] @ v_new, st, chunk_decay[i])
        for b, e in ends.items():
            if e == i:
                snaps[b] = st[b].clone()
    res = out.permute(1, 0, 3, 2, 4).reshape(bsz * nc * chunk, h, dv)
    o = torch.empty(n, h, dv, dtype=res.dtype, device=dev)
    o[src] = res[dst]
    return o, st, snaps


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: q, k (B, H, Dk), v (B, H, Dv), g, beta (B, H) float32; ``state`` (B, H, Dk,
    Dv) updated in place. Returns out (B, H, Dv)."""
    state.mul_(g.exp()[..., None, None])
    kv = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (state * q.unsqueeze(-1)).sum(dim=-2)


class GatedDeltaNet:
    """A linear-attention layer. ``in_proj``: one linear giving [mixed q/k/v (conv_dim), z (value dim), b (Hv),
    a (Hv)]; ``out``: value dim -> hidden. ``conv``: (conv_dim, K) depthwise kernel; ``a_neg``: (Hv,) float32
    A = -exp(A_log); ``dt_bias``: (Hv,) float32; ``norm``: (Dv,) the gated RMSNorm's weight (plain w, not 1 + w).
    ``v_tiled``: value head j reads key head j % Hk (llama.cpp's order) instead of j // (Hv / Hk) (HF's)."""

    def __init__(self, in_proj, out, conv: torch.Tensor, a_neg: torch.Tensor, dt_bias: torch.Tensor,
                 norm: torch.Tensor, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, v_tiled: bool,
                 eps: float) -> None:
        self.in_proj, self.out = in_proj, out
        self.conv, self.a_neg, self.dt_bias, self.norm = conv, a_neg, dt_bias, norm
        self.nk, self.nv, self.dk, self.dv, self.v_tiled, self.eps = num_k_heads, num_v_heads, k_dim, v_dim, v_tiled, eps
        self.key_size, self.value_size = num_k_heads * k_dim, num_v_heads * v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.kernel = conv.shape[1]
        self.rotary = None  # nothing rotated (the model looks rotaries up per layer)

    @classmethod
    def load(cls, src, prefix: str, cfg) -> "GatedDeltaNet":
        """``{prefix}in_proj`` (or ``qkv``, ``z``, ``beta``, ``alpha`` fused here; Qwen3-Next's ``qkvz`` and
        ``ba``, whose rows go per key head, [q, k, v, z] and [b, a], reordered into those), ``out``, ``conv``,
        ``ssm_a`` (A), ``dt_bias``, ``ssm_normw``."""
        nk, r = cfg.linear_num_k_heads, cfg.linear_num_v_heads // cfg.linear_num_k_heads
        sizes = {"qkvz": [cfg.linear_k_head_dim] * 2 + [r * cfg.linear_v_head_dim] * 2, "ba": [r, r]}
        for name, parts in sizes.items():
            if prefix + name in src:
                idx = torch.arange(nk * sum(parts)).view(nk, sum(parts)).split(parts, dim=1)
                perm = torch.cat([i.reshape(-1) for i in idx])  # each part's rows of every key head, in turn
                w = src.weights[prefix + name]
                src.weights[prefix + name] = w[perm] if isinstance(w, torch.Tensor) else reorder_rows(
                    w, lambda x, perm=perm: x[perm])
        names = ["qkvz"] if prefix + "qkvz" in src else ["qkv", "z"]
        names += ["ba"] if prefix + "ba" in src else ["beta", "alpha"]
        in_proj = src.linear(prefix + "in_proj", [prefix + p for p in names], "attn")
        out = src.linear(prefix + "out", [prefix + "out"], "attn")
        conv = src.pop(prefix + "conv").to(src.device, src.dtype).reshape(
            cfg.linear_num_k_heads * cfg.linear_k_head_dim * 2 + cfg.linear_num_v_heads * cfg.linear_v_head_dim, -1)
        f32 = dict(device=src.device, dtype=torch.float32)
        return cls(in_proj, out, conv.contiguous(), src.pop(prefix + "ssm_a").to(**f32).contiguous(),
                   src.pop(prefix + "dt_bias").to(**f32).contiguous(),
                   src.pop(prefix + "ssm_normw").to(src.device, src.dtype).contiguous(), cfg.linear_num_k_heads,
                   cfg.linear_num_v_heads, cfg.linear_k_head_dim, cfg.linear_v_head_dim, cfg.linear_v_tiled,
                   cfg.rms_norm_eps)

    def linear_slots(self, prefix: str):
        yield prefix + "in_proj", self, "in_proj"
        yield prefix + "out", self, "out"

    def norms(self) -> dict[str, torch.Tensor]:
        return {"conv": self.conv, "ssm_a": self.a_neg, "dt_bias": self.dt_bias, "ssm_normw": self.norm}

    def state_shapes(self) -> tuple[tuple[tuple[int, ...], bool], ...]:
        """Per slot, (shape, float32?) of each pool: the convolution's inputs (conv_dim, K - 1) in the model's
        dtype, the recurrent state (Hv, Dk, Dv) in float32."""
        return ((self.conv_dim, self.kernel - 1), False), ((self.nv, self.dk, self.dv), True)

    def _heads(self, mixed: torch.Tensor):
        """Convolved rows (n, conv_dim) -> q, k (n, Hv, Dk) float32, normalised (q scaled), v (n, Hv, Dv) float32."""
        n = mixed.shape[0]
        q, k, v = mixed.float().split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = l2norm(q.reshape(n, self.nk, self.dk)) * self.dk ** -0.5
        k = l2norm(k.reshape(n, self.nk, self.dk))
        r = self.nv // self.nk
        if r > 1:
            q, k = ((x.repeat(1, r, 1) if self.v_tiled else x.repeat_interleave(r, dim=1)) for x in (q, k))
        return q, k, v.reshape(n, self.nv, self.dv)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rot, state: tuple, meta: StateMetadata,
                ops) -> torch.Tensor:
        """x: (T, H) normalised rows -> (T, H). ``state``: this layer's (conv, recurrent) pools."""
        t = x.shape[0]
        conv_pool, rec_pool = state
        proj = self.in_proj(x)
        if proj.dtype != x.dtype:
            proj = proj.to(x.dtype)
        c, vs, nv = self.conv_dim, self.value_size, self.nv
        if ops.fused and self.dv % 16 == 0:  # every sequence through the fused kernel, states updated in place
            return self.out(ops.kernels.gated_delta_rows(
                proj, meta.seqs, conv_pool, rec_pool, self.conv, self.a_neg, self.dt_bias, self.norm, self.nk,
                self.dk, self.dv, self.v_tiled, self.eps))
        rows = meta.decode_rows
        mixed, z = proj[:, :c], proj[:, c:c + vs]
        beta = torch.sigmoid(proj[:, c + vs:c + vs + nv]).float()
        g = self.a_neg * F.softplus(proj[:, c + vs + nv:].float() + self.dt_bias)  # (T, Hv) float32
        out = torch.empty(t, vs, dtype=x.dtype, device=x.device)  # the gated norm's rows
        if meta.num_decodes:
            slots = meta.decode_slots
            xd = mixed if rows is None else mixed[rows]
            y = F.silu(decode_conv(conv_pool, slots, xd, self.conv)).to(x.dtype)
            q, k, v = self._heads(y)
            st = rec_pool[slots]
            o = recurrent_step(q, k, v, g if rows is None else g[rows], beta if rows is None else beta[rows], st)
            rec_pool[slots] = st
            if rows is None:
                return self.out(self._gated_norm(o, z))
            out[rows] = self._gated_norm(o, z[rows])
        if meta.prefills:
            self._prefills(meta.prefills, mixed, z, g, beta, conv_pool, rec_pool, out)
        return self.out(out)

    def _prefills(self, prefills: list[StatePrefill], mixed, z, g, beta, conv_pool, rec_pool, out) -> None:
        """Every prefill chunk of the step: each sequence's convolution over its slot's inputs and its rows, then
        the chunked rule for all of them at once; states (and snapshots) written back to the pools."""
        ys, pieces, saves, pos = [], [], {}, 0
        for b, p in enumerate(prefills):
            n = p.end - p.start
            ys.append(F.silu(prefill_conv(conv_pool, p, mixed[p.start:p.end], self.conv)))  # (n, C)
            if 0 < p.save_rows < n:  # a snapshot inside the chunk: the rows in two pieces, each in whole chunks
                pieces.append([(pos, pos + p.save_rows), (pos + p.save_rows, pos + n)])
                saves[b] = 0
            else:
                pieces.append([(pos, pos + n)])
                if p.save_rows == n:
                    saves[b] = 0
            pos += n
        rows = torch.cat([torch.arange(p.start, p.end) for p in prefills]).to(mixed.device)
        q, k, v = self._heads(torch.cat(ys).to(z.dtype))
        slots = torch.tensor([p.slot for p in prefills], dtype=torch.long, device=mixed.device)
        o, st, snaps = chunk_delta_rule(q, k, v, g[rows], beta[rows], rec_pool[slots], pieces, saves=saves)
        out[rows] = self._gated_norm(o, z[rows])
        rec_pool[slots] = st
        for b, p in enumerate(prefills):
            if b in snaps:
                rec_pool[p.save_slot] = snaps[b]

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each value head (float32), rounded to the model dtype, times the weight, times SiLU(z)
        (float32), rounded: transformers' ``RMSNormGated`` steps."""
        t, dtype = z.shape[0], z.dtype
        if dtype != torch.float32:  # the reference hands the norm the rule's output in the model dtype
            core = core.to(dtype).float()
        y = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.norm * y.to(dtype)
        y = y * F.silu(z.reshape(t, self.nv, self.dv).float())
        return y.to(dtype).reshape(t, self.value_size)

    __call__ = forward
