"""Mamba-2 (Dao & Gu 2024, state space duality), the recurrent layers of Granite 4.0-H: a fixed-size state per
sequence instead of a KV cache.

Per layer and sequence the state is the short convolution's last ``K - 1`` inputs (conv_dim channels: the inner
x, then B and C of every group; the model's dtype) and a (heads, head_dim, d_state) float32 matrix ``S``. Each
token: one projection gives the gate z, the convolved [x, B, C] (causal depthwise convolution with its bias, SiLU)
and dt; dt = softplus(dt + dt_bias); S = exp(dt A) S + dt x B^T; y = S C + D x per head (head h reads group h //
(heads / groups)); y times SiLU(z) is RMS-normalised per group, times the norm weight, and projected back. Decode
rows run that recurrence, batched over sequences (on the fused kernels one C++ pass over each state,
``mamba2_step``); a prefill chunk runs the chunked form (within a chunk of 64
rows the decays between every pair of rows, across chunks the state carried), transformers' float32 steps.

The states live in the worker's pools (``worker.kv_cache``) at each sequence's slot, read and written through
``StateMetadata`` as Gated DeltaNet's (``layers.gated_deltanet``), prefix snapshots included. Both ops backends run
these torch operations, but for the decode rows' recurrence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.gated_deltanet import CHUNK, StateMetadata, decode_conv, prefill_conv


def ssd_chunk(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              state: torch.Tensor) -> torch.Tensor:
    """One sequence's rows within a chunk: x (n, H, P), dt (n, H) (after softplus), a (H,) = A < 0, b, c (n, H, N)
    float32; ``state`` (H, P, N) updated in place to the state after the last row. Returns y (n, H, P) without the
    D skip."""
    n = x.shape[0]
    cum = torch.cumsum(dt * a, dim=0)  # (n, H): the decay's log from the chunk's start through each row
    xdt = x * dt.unsqueeze(-1)
    seg = cum.t().unsqueeze(-1) - cum.t().unsqueeze(-2)  # (H, n, n): row t's log-decay since row s
    seg = seg.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    scores = torch.einsum("thn,shn->hts", c, b) * seg.exp()  # (H, n, n)
    y = torch.einsum("hts,shp->thp", scores, xdt)
    y += torch.einsum("hpn,thn->thp", state, c) * cum.exp().unsqueeze(-1)  # the state from before the chunk
    tail = (cum[-1] - cum).exp().unsqueeze(-1)  # (n, H, 1): each row's decay to the chunk's end
    state.mul_(cum[-1].exp()[:, None, None]).add_(torch.einsum("shp,shn->hpn", xdt * tail, b))
    return y


class Mamba2:
    """``in_proj``: hidden -> [z (inner), x/B/C (conv_dim), dt (heads)]; ``out``: inner -> hidden; ``conv``:
    (conv_dim, K) depthwise kernel and ``conv_bias`` (conv_dim,) or None; ``a_neg`` (H,) float32 A = -exp(A_log);
    ``dt_bias``, ``d_skip`` (H,) float32; ``norm`` (inner,) the grouped gated RMSNorm's weight."""

    def __init__(self, in_proj, out, conv: torch.Tensor, conv_bias: torch.Tensor | None, a_neg: torch.Tensor,
                 dt_bias: torch.Tensor, d_skip: torch.Tensor, norm: torch.Tensor, heads: int, head_dim: int,
                 groups: int, d_state: int, eps: float) -> None:
        self.in_proj, self.out = in_proj, out
        self.conv, self.conv_bias, self.a_neg, self.dt_bias, self.d_skip, self.norm = (
            conv, conv_bias, a_neg, dt_bias, d_skip, norm)
        self.heads, self.head_dim, self.groups, self.d_state, self.eps = heads, head_dim, groups, d_state, eps
        self.inner = heads * head_dim
        self.conv_dim = self.inner + 2 * groups * d_state
        self.kernel = conv.shape[1]
        self.rotary = None  # nothing rotated

    @classmethod
    def load(cls, src, prefix: str, cfg) -> "Mamba2":
        """``{prefix}in_proj``, ``out``, ``conv`` (and ``conv_bias`` where the model has one), ``ssm_a`` (A),
        ``dt_bias``, ``ssm_d`` (D), ``ssm_normw``."""
        in_proj = src.linear(prefix + "in_proj", [prefix + "in_proj"], "attn")
        out = src.linear(prefix + "out", [prefix + "out"], "attn")
        conv = src.pop(prefix + "conv")
        bias = src.pop(prefix + "conv_bias") if prefix + "conv_bias" in src else None
        f32 = dict(device=src.device, dtype=torch.float32)
        return cls(in_proj, out, conv.reshape(conv.shape[0], -1).to(src.device, src.dtype).contiguous(),
                   None if bias is None else bias.reshape(-1).to(src.device, src.dtype).contiguous(),
                   src.pop(prefix + "ssm_a").reshape(-1).to(**f32).contiguous(),
                   src.pop(prefix + "dt_bias").reshape(-1).to(**f32).contiguous(),
                   src.pop(prefix + "ssm_d").reshape(-1).to(**f32).contiguous(),
                   src.pop(prefix + "ssm_normw").reshape(-1).to(src.device, src.dtype).contiguous(),
                   cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_groups, cfg.mamba_state, cfg.rms_norm_eps)

    def linear_slots(self, prefix: str):
        yield prefix + "in_proj", self, "in_proj"
        yield prefix + "out", self, "out"

    def norms(self) -> dict[str, torch.Tensor]:
        out = {"conv": self.conv, "ssm_a": self.a_neg, "dt_bias": self.dt_bias, "ssm_d": self.d_skip,
               "ssm_normw": self.norm}
        return out if self.conv_bias is None else out | {"conv_bias": self.conv_bias}

    def state_shapes(self) -> tuple[tuple[tuple[int, ...], bool], ...]:
        """Per slot: the convolution's inputs (conv_dim, K - 1) in the model's dtype, the state (H, P, N) in
        float32."""
        return ((self.conv_dim, self.kernel - 1), False), ((self.heads, self.head_dim, self.d_state), True)

    def _split(self, y: torch.Tensor):
        """Convolved rows (n, conv_dim) -> x (n, H, P), B and C (n, H, N) per head, float32."""
        n, g, ns = y.shape[0], self.groups, self.d_state
        x, b, c = y.float().split([self.inner, g * ns, g * ns], dim=-1)
        r = self.heads // g
        b, c = (t.reshape(n, g, ns).repeat_interleave(r, dim=1) for t in (b, c))
        return x.reshape(n, self.heads, self.head_dim), b, c

    def _conv_out(self, y: torch.Tensor) -> torch.Tensor:
        return F.silu(y if self.conv_bias is None else y + self.conv_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rot, state: tuple, meta: StateMetadata,
                ops) -> torch.Tensor:
        """x: (T, H) normalised rows -> (T, H). ``state``: this layer's (conv, ssm) pools."""
        conv_pool, ssm_pool = state
        proj = self.in_proj(x)
        if proj.dtype != x.dtype:
            proj = proj.to(x.dtype)
        z, xbc = proj[:, :self.inner], proj[:, self.inner:self.inner + self.conv_dim]
        dt = F.softplus(proj[:, self.inner + self.conv_dim:].float() + self.dt_bias)  # (T, H)
        y = torch.empty(x.shape[0], self.heads, self.head_dim, dtype=torch.float32, device=x.device)
        rows = meta.decode_rows
        if meta.num_decodes:
            slots = meta.decode_slots
            conv = self._conv_out(decode_conv(conv_pool, slots, xbc if rows is None else xbc[rows], self.conv))
            xs, b, c = self._split(conv.to(x.dtype))
            dtd = dt if rows is None else dt[rows]
            if ops.fused:  # one pass over each state, in place in the pool
                yd = ops.kernels.mamba2_step(xs.contiguous(), dtd.contiguous(), b, c, self.a_neg, self.d_skip,
                                             ssm_pool, slots)
            else:
                st = ssm_pool[slots]  # (B, H, P, N)
                st.mul_((dtd * self.a_neg).exp()[..., None, None]).add_((xs * dtd.unsqueeze(-1)).unsqueeze(-1) *
                                                                        b.unsqueeze(-2))
                ssm_pool[slots] = st
                yd = (st * c.unsqueeze(-2)).sum(-1) + xs * self.d_skip[:, None]
            if rows is None:
                return self.out(self._gated_norm(yd, z))
            y[rows] = yd
        for p in meta.prefills:
            conv = self._conv_out(prefill_conv(conv_pool, p, xbc[p.start:p.end], self.conv))
            xs, b, c = self._split(conv.to(x.dtype))
            dtp, st, n = dt[p.start:p.end], ssm_pool[p.slot].clone(), p.end - p.start
            # chunks of CHUNK rows, a boundary where a prefix snapshot is taken
            cuts = sorted({*range(0, n, CHUNK), n} | ({p.save_rows} if 0 < p.save_rows < n else set()))
            for lo, hi in zip(cuts, cuts[1:]):
                y[p.start + lo:p.start + hi] = ssd_chunk(xs[lo:hi], dtp[lo:hi], self.a_neg, b[lo:hi], c[lo:hi], st)
                if hi == p.save_rows:
                    ssm_pool[p.save_slot] = st
            ssm_pool[p.slot] = st
            y[p.start:p.end] += xs * self.d_skip[:, None]
        return self.out(self._gated_norm(y, z))

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """(T, H, P) float32 -> (T, inner): the scan's output in the model dtype (as the reference hands it on),
        times SiLU(z), RMS-normalised per group in float32, rounded, times the weight."""
        t, dtype = z.shape[0], z.dtype
        v = y.reshape(t, self.inner).to(dtype).float() * F.silu(z.float())
        v = v.view(t, self.groups, -1)
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm * v.view(t, self.inner).to(dtype)

    __call__ = forward
