"""The small operations between a layer's matmuls, behind one interface with two backends, so that each layer has
one ``forward``:

- ``FusedOps``: the C++ CPU kernels (``pagedllm.kernels``): the residual add folded into the next RMSNorm, rotary
  and the K/V cache write in one pass, decode attention reading the cache's blocks in place, the MLP in pieces of
  ``mlp_rows`` rows;
- ``EncoderOps``: the same kernels for an encoder (no KV cache), and its attention on AMX-BF16 tiles where there;
- ``TorchOps``: the same arithmetic as torch operations (CUDA, float16, a CPU without a compiler).

All keep the same in-place conventions: ``add_rms_norm`` adds into the residual stream ``h`` (``add_layer_norm``
returns the new rows, which ``EncoderOps`` writes over ``h``); ``qk_norm`` and
``rope_write_kv`` rewrite the q and k heads inside the fused qkv projection's output. ``choose_ops`` is the choice
the model is built with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_ops
from pagedllm.layers.attention import bidirectional_attention, write_kv
from pagedllm.layers.norm import rms_norm
from pagedllm.layers.rotary import RotaryEmbedding

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu}
# The fused path runs a step's MLP in pieces of this many rows: a 2048-token prefill step's gate/up output is
# ~150 MB for a 1.5B model (a fresh mmap, page-faulted in, on every layer), 256 rows' ~18 MB is reused from the heap
# and stays in cache between gate/up, the activation and down. The kernels' rows do not depend on their batch, so
# the results are the same.
MLP_ROWS = 256


def _act_and_mul(fn):
    def act_and_mul(gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu.chunk(2, dim=-1)
        return fn(gate) * up
    return act_and_mul


# gpt-oss's experts: the gate clamped above and the up projection both ways at 7, gate * sigmoid(1.702 gate) * (up + 1)
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


def _swiglu_oai(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
    up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


_ACT_AND_MUL = {name: _act_and_mul(fn) for name, fn in ACTIVATIONS.items()} | {"swiglu_oai": _swiglu_oai}


class TorchOps:
    """torch operations (any device and dtype)."""

    fused = False
    kernels = None  # what ``paged_attention`` runs decode attention with (None: torch's SDPA over gathered blocks)
    mlp_rows = 0  # the MLP runs on all of a step's rows at once
    qkv_dtype = None  # the dtype q, k and v are normalised and rotated in (None: the layer input's)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """h += delta (in place), then RMSNorm(h)."""
        h.add_(delta)
        return rms_norm(h, weight, eps)

    def qk_norm(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, nq: int, nkv: int,
                eps: float) -> torch.Tensor:
        t, d = qkv.shape[0], q_norm.shape[0]
        qk = qkv[:, : (nq + nkv) * d].view(t, nq + nkv, d)
        qk[:, :nq] = rms_norm(qk[:, :nq], q_norm, eps)
        qk[:, nq:] = rms_norm(qk[:, nq:], k_norm, eps)
        return qkv

    def step_rotary(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) ``rope_write_kv`` rotates a step with: here the step's (T, 1, D/2) rows, looked up once
        per step and shared by the layers of that rotary."""
        return rotary.cos_sin(positions)

    def rope_write_kv(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      slots: torch.Tensor | None, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, nq: int,
                      nkv: int) -> None:
        """q and k heads of qkv rotated in place by the step's rotary (``step_rotary``'s cos and sin); k and v
        written to the caches at ``slots`` (None: no cache, an encoder)."""
        t, d = qkv.shape[0], qkv.shape[1] // (nq + 2 * nkv)
        qk = qkv[:, : (nq + nkv) * d].view(t, nq + nkv, d)
        qk.copy_(RotaryEmbedding.apply((cos, sin), qk))
        if k_cache is not None and nkv:  # (nkv 0: q alone, a layer reading another's K/V)
            kv = qkv[:, nq * d:].view(t, 2, nkv, d)
            write_kv(k_cache, v_cache, kv[:, 0], kv[:, 1], slots)

    def bidirectional_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]],
                                scale: float, radius: int = 0) -> torch.Tensor:
        """An encoder's attention over the step's spans (``layers.attention.bidirectional_attention``)."""
        return bidirectional_attention(q, k, v, spans, scale, radius)

    def act_and_mul(self, act: str):
        """gate_up (T, 2I) -> act(gate) * up (T, I)."""
        return _ACT_AND_MUL[act]

    def act(self, act: str):
        """An ungated MLP's activation (BERT's GELU)."""
        return ACTIVATIONS[act]

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        """LayerNorm over the last dimension, with its bias (BERT's post-norm layers)."""
        return F.layer_norm(x, weight.shape, weight, bias, eps)

    def add_layer_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """BERT's post-norm step: LayerNorm(h + delta) -> (the new residual rows, the rows the next linear reads:
        here the same tensor)."""
        h = F.layer_norm(h + delta, weight.shape, weight, bias, eps)
        return h, h


class FusedOps(TorchOps):
    """The fused CPU kernels (float32 / bfloat16 on CPU). The operations whose signature is the kernel's are the
    kernel functions themselves (no Python frame between a layer and the C++)."""

    fused = True
    mlp_rows = MLP_ROWS

    def __init__(self, kernels) -> None:
        self.kernels = kernels
        self.rms_norm = kernels.rms_norm
        self.add_rms_norm = kernels.add_rms_norm
        self.qk_norm = kernels.qk_norm
        self.rope_write_kv = kernels.rope_write_kv  # slots and caches required (``EncoderOps``: none)
        self._act = {"silu": kernels.silu_and_mul, "gelu_tanh": kernels.gelu_tanh_and_mul,
                     "swiglu_oai": kernels.swiglu_oai_and_mul}

    def step_rotary(self, rotary, positions):
        return rotary.cos32, rotary.sin32  # the whole float32 tables: the kernel looks the positions up itself

    def act_and_mul(self, act):
        fused = self._act.get(act)
        return fused if fused is not None else super().act_and_mul(act)


class EncoderOps(FusedOps):
    """An encoder's backend: the fused kernels with no KV cache. The rotary kernel turns the k heads in place as
    it turns the q heads (all of them taken as queries: nothing is written to a cache). ``bf16_linears``: bfloat16
    linears under a float32 residual stream; the norms then add the linears' bfloat16 outputs and write the next
    linear's bfloat16 input in their one pass (no casts around each GEMM)."""

    mlp_rows = 0  # (an encoder's bfloat16 GEMMs on oneDNN: whole steps measured faster than pieces)

    def __init__(self, kernels, bf16_linears: bool = False, final_norm: torch.Tensor | None = None) -> None:
        """``final_norm``: the weight of the norm whose rows are the model's output (pooled, not a linear's input:
        kept in float32)."""
        super().__init__(kernels)
        self._rope = kernels.rope_write_kv
        self.rope_write_kv = self._rope_in_place
        if bf16_linears:  # (in float32 here: q and k rounded to bfloat16 after the rotary cost 2-4x the cosine error)
            self.qkv_dtype = torch.float32
            self.rms_norm = lambda h, w, eps: kernels.rms_norm(h, w, eps, w is not final_norm)
            self.add_rms_norm = lambda h, d, w, eps: kernels.add_rms_norm(h, d, w, eps, w is not final_norm)
            self.add_layer_norm = lambda h, d, w, b, eps: (h, kernels.add_layer_norm(h, d, w, b, eps))

    def bidirectional_attention(self, q, k, v, spans, scale, radius=0):
        """On the AMX-BF16 tiles (``encoder_attention``) where they run, for bfloat16 q, k, v (what bfloat16
        linears give: no rounding added but the probabilities') and heads of a multiple of 32; not with a window
        shorter than a text (EmbeddingGemma's sliding layers on long texts)."""
        if (q.dtype == torch.bfloat16 and q.shape[-1] % 32 == 0 and self.kernels.encoder_attention_tiles()
                and not (radius and max(e - s for s, e in spans) > radius + 1)):
            return self.kernels.encoder_attention(q, k, v, torch.tensor(spans, dtype=torch.long), scale)
        return bidirectional_attention(q, k, v, spans, scale, radius)

    def _rope_in_place(self, qkv, positions, cos, sin, slots, k_cache, v_cache, nq: int, nkv: int) -> None:
        t, d = qkv.shape[0], qkv.shape[1] // (nq + 2 * nkv)
        none = qkv.new_empty(1, 1, 1, d)  # a one-slot "cache" the kernel checks the head size against
        self._rope(qkv[:, : (nq + nkv) * d], positions, cos, sin, torch.zeros(t, dtype=torch.long), none, none,
                   nq + nkv, 0)


def choose_ops(device: torch.device, dtype: torch.dtype, encoder: bool = False,
               linear_dtype: torch.dtype | None = None, final_norm: torch.Tensor | None = None) -> TorchOps:
    """The fused kernels where they run (CPU, float32 or bfloat16 activations, the kernels built: ``cpu_ops``,
    asked only there), else torch. ``encoder``: no KV cache to write (``EncoderOps``; ``linear_dtype``: its
    linears' dtype where not ``dtype``; ``final_norm``: its last norm's weight)."""
    kernels = cpu_ops() if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) else None
    if kernels is None:
        return TorchOps()
    if encoder:
        return EncoderOps(kernels, dtype == torch.float32 and linear_dtype == torch.bfloat16, final_norm)
    return FusedOps(kernels)
