"""Which scheme each layer type gets: a per-layer-type quantization policy.

Layer types: ``attn`` (fused q/k/v and the output projection), ``mlp`` (fused gate/up and down), ``lm_head`` and
``embed``. Schemes: ``none`` (model dtype), ``int8`` (symmetric per output channel), ``int4`` (group-wise),
``fp8`` (e4m3, per-channel scales). A tied embedding shares the LM head's int8 table when both are int8.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from pagedllm.quant.formats import Fp8Weight, QuantizedWeight, quantize_fp8, quantize_rtn

SCHEMES = ("none", "int8", "int4", "fp8")
LAYER_TYPES = ("attn", "mlp", "lm_head", "embed")
LINEAR_TYPES = {"qkv": "attn", "o": "attn", "gate_up": "mlp", "down": "mlp"}


@dataclass(frozen=True)
class QuantPolicy:
    attn: str = "none"
    mlp: str = "none"
    lm_head: str = "none"
    embed: str = "none"
    group_size: int = 64  # for int4
    symmetric: bool = False  # for int4 (int8 is always symmetric: torch's int8 kernel has no zero point)

    def __post_init__(self) -> None:
        for t in LAYER_TYPES:
            if getattr(self, t) not in SCHEMES:
                raise ValueError(f"quantization scheme for {t!r} must be one of {SCHEMES}, got {getattr(self, t)!r}")
        if self.embed not in ("none", "int8"):
            raise ValueError("the embedding can only be kept unquantized or int8 (rows are dequantized on lookup)")
        if self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"group size must be 32, 64, 128 or 256, got {self.group_size}")

    def scheme(self, layer_type: str) -> str:
        return getattr(self, layer_type)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def parse(cls, spec: str, **kw) -> "QuantPolicy":
        """``attn=int8,mlp=int4,lm_head=int8`` (types not named stay ``none``)."""
        fields = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in LAYER_TYPES:
                raise ValueError(f"bad policy entry {part!r}: expected TYPE=SCHEME with TYPE in {LAYER_TYPES}")
            fields[key.strip()] = value.strip()
        return cls(**fields, **kw)


# what --quantization int8 / fp8 do when quantizing a full-precision model at load time
ON_THE_FLY = {
    "int8": QuantPolicy(attn="int8", mlp="int8", lm_head="int8", embed="int8"),
    "fp8": QuantPolicy(attn="fp8", mlp="fp8"),
}


def quantize_weight(w: torch.Tensor, scheme: str, policy: QuantPolicy) -> torch.Tensor | QuantizedWeight | Fp8Weight:
    """Round-to-nearest quantization of one float weight under ``scheme``."""
    if scheme == "none":
        return w
    if scheme == "int8":
        return quantize_rtn(w, 8, w.shape[1], symmetric=True)
    if scheme == "int4":
        return quantize_rtn(w, 4, policy.group_size, policy.symmetric)
    if scheme == "fp8":
        return quantize_fp8(w)
    raise ValueError(scheme)
