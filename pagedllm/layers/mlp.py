"""The feed-forward layers: a gated MLP (SwiGLU / GeGLU: down(act(gate) * up), gate and up one fused projection;
gpt-oss's clamped SwiGLU with biases), a mixture of experts of them behind a router, and BERT's ungated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.ops import TorchOps
from pagedllm.layers.weights import WeightSource


class GatedMLP:
    # tensor-parallel split (``distributed.sharding``): gate/up rows by intermediate channel, down's columns
    TP_SPLIT = {"gate": ("rows", "intermediate"), "up": ("rows", "intermediate"), "down": ("cols", "intermediate"),
                "gate_bias": ("rows", "intermediate"), "up_bias": ("rows", "intermediate"), "down_bias": ("first", "")}

    def __init__(self, gate_up, down, act: str) -> None:
        self.gate_up, self.down, self.act = gate_up, down, act

    @classmethod
    def load(cls, src: WeightSource, prefix: str, act: str, dense: bool = True) -> "GatedMLP":
        """``{prefix}gate_up`` (or ``gate`` and ``up``, fused here) and ``{prefix}down``, with their biases where the
        checkpoint has them (``gate_bias`` / ``up_bias``, ``down_bias``: gpt-oss's experts)."""
        gate_up_bias = down_bias = None
        if prefix + "gate_bias" in src:
            gate_up_bias = torch.cat([src.pop(prefix + "gate_bias"), src.pop(prefix + "up_bias")])
            down_bias = src.pop(prefix + "down_bias")
        return cls(src.linear(prefix + "gate_up", [prefix + "gate", prefix + "up"], "mlp", gate_up_bias, dense=dense),
                   src.linear(prefix + "down", [prefix + "down"], "mlp", down_bias, dense=dense), act)

    def linear_slots(self, prefix: str):
        yield prefix + "gate_up", self, "gate_up"
        yield prefix + "down", self, "down"

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        gate_up, down = self.gate_up, self.down
        act_and_mul = ops.act_and_mul(self.act)
        if ops.fused and hasattr(gate_up, "gated"):  # packed weights' own large-step path (bfloat16 stripes)
            y = gate_up.gated(x, act_and_mul, down)
            if y is not None:
                return y
        rows = ops.mlp_rows
        # whole where a piece would take gate_up's stripes (each piece would decode every weight again)
        if not rows or x.shape[0] <= rows or 0 < getattr(gate_up, "bf16_min_tokens", 0) <= rows:
            return down(act_and_mul(gate_up(x)))
        return torch.cat([down(act_and_mul(gate_up(x[i:i + rows]))) for i in range(0, x.shape[0], rows)])

    __call__ = forward


class MLP:
    """down(act(up(x))) with biases (BERT's feed-forward block)."""

    def __init__(self, up, down, act: str) -> None:
        self.up, self.down, self.act = up, down, act

    @classmethod
    def load(cls, src: WeightSource, prefix: str, act: str) -> "MLP":
        """``{prefix}up`` / ``{prefix}down`` and their biases ``up_bias`` / ``down_bias``."""
        return cls(*(src.linear(prefix + n, [prefix + n], "mlp", src.pop(prefix + n + "_bias"), dense=False)
                     for n in ("up", "down")), act)

    def linear_slots(self, prefix: str):
        yield prefix + "up", self, "up"
        yield prefix + "down", self, "down"

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return self.down(ops.act(self.act)(self.up(x)))

    __call__ = forward


class MoE:
    """Softmax over the router's logits (float32; the router's bias added where it has one: gpt-oss), the top k
    experts per token (renormalised where the model says: the same as a softmax over the top k logits, gpt-oss's
    order), and the step's tokens grouped per expert, so each chosen expert runs once on all of its tokens; experts
    are added in ascending order, as the reference does."""

    def __init__(self, router: torch.Tensor, experts: list[GatedMLP], top_k: int, norm_topk_prob: bool,
                 router_bias: torch.Tensor | None = None, shared: GatedMLP | None = None,
                 shared_gate: torch.Tensor | None = None, expert_scale: torch.Tensor | None = None,
                 scoring: str = "softmax", select_bias: torch.Tensor | None = None, routed_scale: float = 1.0) -> None:
        """``shared``: an expert every token goes through, its output times sigmoid(x . ``shared_gate``) (Qwen 3.5
        MoE, Qwen3-Next; no gate: Granite); ``expert_scale``: each chosen expert's weight times its entry, after the renormalisation
        (Gemma 4); ``scoring`` "sigmoid": each expert's score is sigmoid(logit), the top k chosen by score plus
        ``select_bias`` (where given), their scores renormalised (+1e-6) and times ``routed_scale`` (LFM2-MoE)."""
        self.router, self.experts, self.top_k, self.norm_topk_prob = router, experts, top_k, norm_topk_prob
        self.scoring, self.select_bias, self.routed_scale = scoring, select_bias, routed_scale
        self.router_bias, self.expert_scale = router_bias, expert_scale
        self.shared, self.shared_gate = shared, shared_gate

    @classmethod
    def load(cls, src: WeightSource, prefix: str, act: str, num_experts: int, top_k: int,
             norm_topk_prob: bool, scoring: str = "softmax", routed_scale: float = 1.0) -> "MoE":
        """``{prefix}router`` (float, small; dequantized if stored in blocks) and per expert ``{prefix}experts.{e}.``
        its gated MLP, without dense copies (an expert sees ~k/E of a step's rows, rarely enough to pay for one)."""
        router = src.float_tensor(prefix + "router")
        bias = src.float_tensor(prefix + "router_bias") if prefix + "router_bias" in src else None
        experts = [GatedMLP.load(src, f"{prefix}experts.{e}.", act, dense=False) for e in range(num_experts)]
        shared = shared_gate = None
        if prefix + "shared.down" in src or prefix + "shared.gate_up" in src:  # a gated shared expert
            shared = GatedMLP.load(src, prefix + "shared.", act)
            shared_gate = src.float_tensor(prefix + "shared_gate") if prefix + "shared_gate" in src else None
        scale = src.pop(prefix + "expert_scale").float() if prefix + "expert_scale" in src else None
        select = src.pop(prefix + "expert_bias").float() if prefix + "expert_bias" in src else None
        return cls(router, experts, top_k, norm_topk_prob, bias, shared, shared_gate, scale, scoring, select,
                   routed_scale)

    def linear_slots(self, prefix: str):
        for e, expert in enumerate(self.experts):
            yield from expert.linear_slots(f"{prefix}experts.{e}.")
        if self.shared is not None:
            yield from self.shared.linear_slots(prefix + "shared.")

    def forward(self, x: torch.Tensor, ops: TorchOps, router_x: torch.Tensor | None = None) -> torch.Tensor:
        """``router_x``: what the router reads, where not the experts' input (Gemma 4)."""
        logits = F.linear(x if router_x is None else router_x, self.router, self.router_bias)
        if self.scoring == "sigmoid":
            scores = logits.sigmoid()
            pick = scores if self.select_bias is None else scores + self.select_bias.to(scores.device)
            chosen = torch.topk(pick, self.top_k, dim=-1)[1]
            weights = scores.gather(1, chosen)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
            weights = weights * self.routed_scale
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (T, k)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale.to(weights.device)[chosen]
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            slot, rows = torch.where((chosen == e).T)  # (k, T) order: by slot, then token, as the reference
            y = self.experts[e](x[rows].contiguous(), ops)
            out.index_add_(0, rows, y * weights[rows, slot, None])
        if self.shared is not None:  # (ungated: Granite's shared MLP)
            shared = self.shared(x, ops)
            out += shared if self.shared_gate is None else torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out

    __call__ = forward


class DenseAndExperts:
    """Gemma 4's mixture-of-experts block (26B-A4B): a dense MLP and a mixture of experts side by side, both from
    the residual stream after attention: the dense MLP on the layer's usual norm of it, its output normalised; the
    experts on a second norm of it, routed from its weightless RMS norm times a learned scale and hidden^-0.5, their
    output normalised; the two added (the layer's own output norm follows)."""

    takes_residual = True  # forward reads the residual stream h as well as its normalised x

    def __init__(self, dense: GatedMLP, moe: MoE, dense_norm: torch.Tensor, experts_in_norm: torch.Tensor,
                 experts_norm: torch.Tensor, router_scale: torch.Tensor, eps: float) -> None:
        self.dense, self.moe, self.eps = dense, moe, eps
        self.dense_norm, self.experts_in_norm, self.experts_norm = dense_norm, experts_in_norm, experts_norm
        self.router_scale = router_scale  # (H,) float32, times hidden^-0.5 as the reference applies it

    @classmethod
    def load(cls, src: WeightSource, prefix: str, act: str, num_experts: int, top_k: int,
             eps: float) -> "DenseAndExperts":
        """The dense MLP's ``gate``/``up``/``down``, the experts (``MoE.load``: ``router``, ``experts.{e}.``,
        ``expert_scale``), ``router_scale`` and the norms ``dense_out_norm``, ``experts_in_norm``,
        ``experts_out_norm``."""
        scale = src.pop(prefix + "router_scale").float()
        return cls(GatedMLP.load(src, prefix, act), MoE.load(src, prefix, act, num_experts, top_k, True),
                   src.norm(prefix + "dense_out_norm"), src.norm(prefix + "experts_in_norm"),
                   src.norm(prefix + "experts_out_norm"), scale, eps)

    def linear_slots(self, prefix: str):
        yield from self.dense.linear_slots(prefix)
        yield from self.moe.linear_slots(prefix)

    def norms(self) -> dict[str, torch.Tensor]:
        return {"dense_out_norm": self.dense_norm, "experts_in_norm": self.experts_in_norm,
                "experts_out_norm": self.experts_norm}

    def forward(self, x: torch.Tensor, ops: TorchOps, h: torch.Tensor) -> torch.Tensor:
        dense = ops.rms_norm(self.dense(x, ops).contiguous(), self.dense_norm, self.eps)
        hf = h.float()
        routed = hf * torch.pow(hf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)  # weightless, in float32
        routed = (routed.to(h.dtype) * self.router_scale.to(h.dtype) * h.shape[-1] ** -0.5).to(self.moe.router.dtype)
        experts = self.moe(ops.rms_norm(h, self.experts_in_norm, self.eps), ops, routed)
        return dense + ops.rms_norm(experts.contiguous(), self.experts_norm, self.eps)

    __call__ = forward
