"""The architecture registry: one small module per architecture, each an ``Arch`` saying how its hyper-parameters
read from GGUF metadata and from an HF ``config.json``, and what its tensors are called where the common names
(``model.loader``) do not cover them. The layers are shared: an architecture picks its variants through
``ModelArchConfig`` fields (QK-norm, activation, sandwich norms, sliding windows, rotary scaling), which
``model.decoder.CausalLM`` reads. Adding one touches neither the scheduler, the runner nor the server: write a
module here and list it in ``_MODULES``."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable


class GGUFMeta:
    """What an architecture's ``from_gguf`` may read: ``kv(name)`` is ``{arch}.{name}``, ``get`` a full key,
    ``tensor_names`` the file's tensors, ``tensor(name)`` one tensor's float32 values, ``token_id(text)`` an id of
    the file's vocabulary."""

    def __init__(self, arch: str, get: Callable[[str, Any], Any], tensor_names: set[str],
                 tensor: Callable[[str], Any]) -> None:
        self.arch, self.get, self.tensor_names, self.tensor = arch, get, tensor_names, tensor
        self._ids: dict[str, int] | None = None

    def kv(self, name: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{name}", default)

    def token_id(self, text: str) -> int | None:
        if self._ids is None:
            self._ids = {t: i for i, t in enumerate(self.get("tokenizer.ggml.tokens", None) or [])}
        return self._ids.get(text)


def _none(_: Any) -> dict:
    return {}


@dataclass(frozen=True)
class Arch:
    name: str  # GGUF ``general.architecture`` and ``ModelArchConfig.arch``
    hf_types: tuple[str, ...]  # the HF ``model_type`` values read as this architecture
    from_gguf: Callable[[GGUFMeta], dict] = _none  # ModelArchConfig fields beyond the common ones
    from_hf: Callable[[dict], dict] = _none
    gguf_names: dict[str, str] = field(default_factory=dict)  # per-layer tensor names beyond/instead of the common
    hf_names: dict[str, str] = field(default_factory=dict)
    hf_norm_plus_one: bool = False  # HF keeps RMSNorm weights w and applies (1 + w); GGUF files store 1 + w
    gguf_permuted_qk: bool = False  # llama.cpp stores q/k rows permuted for its rotary layout
    # where an architecture names its tensors its own way (encoders): the whole-model names, and the prefix of a
    # layer's tensors (``{prefix}{i}.{per-layer name}``); empty: the decoders' ``model.`` names
    hf_global_names: dict[str, str] = field(default_factory=dict)
    gguf_global_names: dict[str, str] = field(default_factory=dict)
    hf_layer_prefix: str = "model.layers."
    tokenizer_type: str | None = None  # transformers' tokenizer type for the GGUF vocabulary (default: hf_types')
    # a layer tensor of an HF checkpoint the architecture splits itself ((name after the layer prefix, tensor) ->
    # {layer-relative engine name: tensor}, or None: the common names apply), e.g. gpt-oss's stacked experts
    split_hf: Callable[[str, Any], dict | None] | None = None
    # where a layer's experts are in an HF checkpoint (e.g. "mlp.experts."): one tensor per expert and part
    # (``{hf_experts}{e}.gate_proj.weight``, or w1 / w3 / w2) or stacked (``{hf_experts}gate_up_proj``, ``down_proj``)
    hf_experts: str = ""


def hf_rope(hf: dict, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(theta, scaling or None) from a config.json: transformers 5's ``rope_parameters`` (per layer type where
    given) or the older ``rope_theta`` / ``rope_scaling``. Only scaling types the rotary implements pass."""
    params = hf.get("rope_parameters") or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type] or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = params if (params.get("rope_type") or params.get("type")) else hf.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind not in ("linear", "llama3", "yarn", "proportional"):
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: linear, llama3, yarn, proportional")
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")} | {"rope_type": kind}
    if kind == "yarn" and out.get("factor") is None:  # transformers: the context's growth
        out["factor"] = hf.get("max_position_embeddings", 2048) / out["original_max_position_embeddings"]
    return theta, out


def gguf_experts(meta: GGUFMeta) -> dict:
    """A mixture of experts' sizes from llama.cpp's keys (none: a dense model)."""
    if not meta.kv("expert_count"):
        return {}
    return {"num_experts": int(meta.kv("expert_count")), "num_experts_per_tok": int(meta.kv("expert_used_count")),
            "moe_intermediate_size": int(meta.kv("expert_feed_forward_length", meta.kv("feed_forward_length")))}


def gguf_linear_rope(meta: GGUFMeta) -> dict:
    """llama.cpp's linear rotary scaling (position interpolation), where the file sets it."""
    if meta.kv("rope.scaling.type") != "linear":
        return {}
    return {"rope_scaling": {"rope_type": "linear", "factor": float(meta.kv("rope.scaling.factor"))}}


def sliding_everywhere(window: int | None, layers: int) -> dict:
    """A sliding window on every layer (Mistral, Phi-3), or nothing without a window."""
    return {"sliding_window": window, "layer_types": ("sliding",) * layers} if window else {}


def no_sliding_window(hf: dict) -> dict:
    """Qwen's optional sliding window (``use_sliding_window``, for layers past ``max_window_layers``): refused,
    not silently run as full attention."""
    if hf.get("use_sliding_window"):
        raise ValueError(f"{hf.get('model_type')}: use_sliding_window (windows on some layers) is not supported")
    return {}


def hf_eos(hf: dict) -> tuple[int | None, tuple[int, ...]]:
    """(eos, other stop ids) from a config's ``eos_token_id`` (an id or a list of them)."""
    eos = hf.get("eos_token_id")
    ids = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
    return (ids[0] if ids else None), tuple(ids[1:])


_MODULES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma2", "gemma3", "gemma4", "phi3", "smollm3", "ministral3",
            "gpt_oss", "lfm2", "lfm2_moe", "granite_hybrid", "bert", "gemma_embedding")
ARCHS: dict[str, Arch] = {}
for _m in _MODULES:
    _a = importlib.import_module(f"{__name__}.{_m}").ARCH
    ARCHS[_a.name] = _a
HF_TYPES: dict[str, Arch] = {t: a for a in ARCHS.values() for t in a.hf_types}
