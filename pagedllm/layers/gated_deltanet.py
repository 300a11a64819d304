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


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (transformers' and FLA's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's rows through the gated delta rule in chunks. q, k: (L, H, Dk) float32 (normalised, q
    scaled); v: (L, H, Dv); g, beta: (L, H); state: (H, Dk, Dv) float32, the state before the first row. Returns
    (out (L, H, Dv), the state after the last row)."""
    n = q.shape[0]
    chunk = min(chunk, n)
    pad = (chunk - n % chunk) % chunk
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # (H, L', D)
    beta, g = (F.pad(x.transpose(0, 1), (0, pad)) for x in (beta, g))  # (H, L')
    h = q.shape[0]
    nc = q.shape[1] // chunk
    v_beta = (v * beta.unsqueeze(-1)).view(h, nc, chunk, -1)
    k_beta = (k * beta.unsqueeze(-1)).view(h, nc, chunk, -1)
    q, k = q.view(h, nc, chunk, -1), k.view(h, nc, chunk, -1)
    cum = g.view(h, nc, chunk).cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # (H, C, c, c)
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # (H, C, 1, 1)
    out = torch.empty_like(new_v)
    s = state
    for i in range(nc):
        v_new = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(h, nc * chunk, -1)[:, :n].transpose(0, 1), s


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
        """``{prefix}in_proj`` (or ``qkv``, ``z``, ``beta``, ``alpha`` fused here), ``out``, ``conv``, ``ssm_a``
        (A), ``dt_bias``, ``ssm_normw``."""
        in_proj = src.linear(prefix + "in_proj", [prefix + p for p in ("qkv", "z", "beta", "alpha")], "attn")
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

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per slot: the convolution's inputs (conv_dim, K - 1) and the recurrent state (Hv, Dk, Dv)."""
        return (self.conv_dim, self.kernel - 1), (self.nv, self.dk, self.dv)

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
        mixed, z = proj[:, :c], proj[:, c:c + vs]
        beta = torch.sigmoid(proj[:, c + vs:c + vs + nv]).float()
        g = self.a_neg * F.softplus(proj[:, c + vs + nv:].float() + self.dt_bias)  # (T, Hv) float32
        core = torch.empty(t, nv, self.dv, dtype=torch.float32, device=x.device)
        w = self.conv
        if meta.num_decodes:
            rows, slots = meta.decode_rows, meta.decode_slots
            xd = mixed if rows is None else mixed[rows]
            window = torch.cat([conv_pool[slots], xd.unsqueeze(-1).to(conv_pool.dtype)], dim=-1)  # (B, C, K)
            conv_pool[slots] = window[:, :, 1:]
            y = F.silu((window.to(w.dtype) * w).sum(dim=-1)).to(x.dtype)
            q, k, v = self._heads(y)
            s = rec_pool[slots]
            o = recurrent_step(q, k, v, g if rows is None else g[rows], beta if rows is None else beta[rows], s)
            rec_pool[slots] = s
            if rows is None:
                core = o
            else:
                core[rows] = o
        for p in meta.prefills:
            n = p.end - p.start
            seq = torch.cat([conv_pool[p.slot], mixed[p.start:p.end].t().to(conv_pool.dtype)], dim=-1)  # (C, K-1+n)
            y = F.conv1d(seq.unsqueeze(0).to(w.dtype), w.unsqueeze(1), groups=c)[0]  # (C, n)
            y = F.silu(y).to(x.dtype).t()
            q, k, v = self._heads(y)
            gs, bs = g[p.start:p.end], beta[p.start:p.end]
            s = rec_pool[p.slot]
            if 0 < p.save_rows < n:  # a snapshot at a block boundary inside the chunk: the rows in two runs
                m = p.save_rows
                o1, s = chunk_delta_rule(q[:m], k[:m], v[:m], gs[:m], bs[:m], s)
                rec_pool[p.save_slot] = s
                conv_pool[p.save_slot] = seq[:, m:m + self.kernel - 1]
                o2, s = chunk_delta_rule(q[m:], k[m:], v[m:], gs[m:], bs[m:], s)
                core[p.start:p.end] = torch.cat([o1, o2])
            else:
                o, s = chunk_delta_rule(q, k, v, gs, bs, s)
                core[p.start:p.end] = o
            rec_pool[p.slot] = s
            conv_pool[p.slot] = seq[:, n:]
            if p.save_rows == n:  # the snapshot is the state after the whole chunk
                rec_pool[p.save_slot] = s
                conv_pool[p.save_slot] = seq[:, n:]
        return self.out(self._gated_norm(core, z))

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
