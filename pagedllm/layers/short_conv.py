"""LFM2's short convolution (Liquid AI's gated short-range operator): a layer with a per-sequence state of a few
inputs instead of a KV cache. in_proj gives B, C and x (hidden each); B * x runs through a causal depthwise
convolution over time (kernel ``K``: 3), gated by C, then out_proj: ``out_proj(C * conv(B * x))``.

Its state per sequence is the convolution's last ``K - 1`` inputs (hidden channels, the model's dtype), in the
worker's state pools at the sequence's slot (``worker.kv_cache``), read and written through the same
``StateMetadata`` as Gated DeltaNet's (``layers.gated_deltanet``): decode rows batched, each prefill chunk over its
slot's history, and a prefix snapshot copied where a chunk crosses its prompt's last block boundary."""

from __future__ import annotations

import torch

from pagedllm.layers.gated_deltanet import StateMetadata, decode_conv, prefill_conv


class ShortConv:
    def __init__(self, in_proj, out_proj, conv: torch.Tensor) -> None:
        """``in_proj``: hidden -> [B, C, x] (3 x hidden); ``conv``: (hidden, K) depthwise kernel."""
        self.in_proj, self.out = in_proj, out_proj
        self.conv = conv
        self.hidden, self.kernel = conv.shape
        self.rotary = None  # nothing rotated

    @classmethod
    def load(cls, src, prefix: str) -> "ShortConv":
        """``{prefix}in_proj``, ``{prefix}out``, ``{prefix}conv`` ((hidden, K), or HF's (hidden, 1, K))."""
        in_proj = src.linear(prefix + "in_proj", [prefix + "in_proj"], "attn")
        out = src.linear(prefix + "out", [prefix + "out"], "attn")
        conv = src.pop(prefix + "conv")
        return cls(in_proj, out, conv.reshape(conv.shape[0], -1).to(src.device, src.dtype).contiguous())

    def linear_slots(self, prefix: str):
        yield prefix + "in_proj", self, "in_proj"
        yield prefix + "out", self, "out"

    def norms(self) -> dict[str, torch.Tensor]:
        return {"conv": self.conv}

    def state_shapes(self) -> tuple[tuple[tuple[int, ...], bool], ...]:
        """Per slot: the convolution's last inputs (hidden, K - 1), in the model's dtype."""
        return (((self.hidden, self.kernel - 1), False),)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rot, state: tuple, meta: StateMetadata,
                ops) -> torch.Tensor:
        """x: (T, H) normalised rows -> (T, H). ``state``: this layer's (conv inputs,) pool."""
        (pool,) = state
        bcx = self.in_proj(x)
        if bcx.dtype != x.dtype:
            bcx = bcx.to(x.dtype)
        h = self.hidden
        b, c, xx = bcx[:, :h], bcx[:, h:2 * h], bcx[:, 2 * h:]
        bx = b * xx
        y = torch.empty_like(bx)
        if meta.num_decodes:
            rows, slots = meta.decode_rows, meta.decode_slots
            xd = bx if rows is None else bx[rows]
            yd = decode_conv(pool, slots, xd, self.conv).to(x.dtype)
            if rows is None:
                return self.out(c * yd)
            y[rows] = yd
        for p in meta.prefills:  # (a prefix snapshot: the inputs after save_rows rows, saved by prefill_conv)
            y[p.start:p.end] = prefill_conv(pool, p, bx[p.start:p.end], self.conv).to(x.dtype)
        return self.out(c * y)

    __call__ = forward
