"""The architecture registry: one small module per architecture, each an ``Arch`` saying how its hyper-parameters
read from GGUF metadata and from an HF ``config.json``, and what its tensors are called where the shared names (the
tables below: llama.cpp's GGUF vocabulary, the llama lineage's HF names) do not cover them; the loader reads each
architecture's whole map from its ``Arch``. The layers are shared: an architecture picks its variants through
``ModelArchConfig`` fields (QK-norm, activation, sandwich norms, sliding windows, rotary scaling), which
``model.decoder.CausalLM`` reads. Adding one touches neither the scheduler, the runner nor the server: write a
module here and list it in ``_MODULES``."""

from __future__ import annotations

import importlib
import re
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


# The engine's weight names (``model.decoder.CausalLM``) for the tensor names architectures share: llama.cpp's GGUF
# names (one vocabulary for every architecture, as its converter writes them) and the llama lineage's HF names. An
# architecture's ``Arch`` adds or overrides them (``gguf_names`` / ``hf_names``, ``*_global_names``); the loader
# reads an architecture's whole map (``Arch.gguf_layer_names`` ...), never these tables directly.
GGUF_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_norm",
    "ffn_norm.weight": "post_norm",  # the norm before the MLP
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_qkv.weight": "qkv",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "attn_output.weight": "o",
    "attn_output.bias": "o_bias",
    "post_attention_norm.weight": "attn_out_norm",  # on the attention output (sandwich norms)
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
    "post_ffw_norm.weight": "mlp_out_norm",
    "ffn_gate_inp.weight": "router",  # mixture of experts: the router, and the experts stacked in one tensor each
    "ffn_gate_shexp.weight": "shared.gate",  # a shared expert and its gate (Qwen 3.5 MoE, Qwen 2 MoE)
    "ffn_up_shexp.weight": "shared.up",
    "ffn_down_shexp.weight": "shared.down",
    "ffn_gate_inp_shexp.weight": "shared_gate",
}
GGUF_EXPERTS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up", "ffn_down_exps.weight": "down",
                "ffn_gate_up_exps.weight": "gate_up",  # (fused by the converter's option: gate rows, then up)
                "ffn_gate_exps.bias": "gate_bias", "ffn_up_exps.bias": "up_bias", "ffn_down_exps.bias": "down_bias"}
GGUF_EXPERT_OLD = re.compile(r"ffn_(gate|up|down)\.(\d+)\.weight")  # early Mixtral files: a tensor per expert
# the llama-lineage HF names every decoder shares (attention, the gated MLP, their norms); an architecture's module
# adds its own (``Arch.hf_names``: fused projections, routers, shared experts, ...) and says where its experts are
HF_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
# a multi-token prediction module's own tensors (Qwen 3.5 / Qwen3-Next checkpoints' ``mtp.*``: the next token's
# embedding and the model's last hidden state, each normalised, projected from their concatenation by ``fc``, then
# its decoder layers, ``mtp.layers.{i}.*``, named as the model's own, then its final norm)
HF_MTP_NAMES = {"mtp.fc.weight": "mtp.fc", "mtp.pre_fc_norm_embedding.weight": "mtp.embed_norm",
                "mtp.pre_fc_norm_hidden.weight": "mtp.hidden_norm", "mtp.norm.weight": "mtp.norm"}
HF_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "self_attn.o_proj.weight": "o",
    "self_attn.o_proj.bias": "o_bias",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
# the parts of one expert (after ``Arch.hf_experts`` and its index): qwen's names, and Mixtral's / LFM2's w1 / w3 / w2
HF_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
HF_EXPERT = re.compile(r"(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
# or all experts stacked in 3-D tensors (transformers' in-memory layout): (E, 2I, H) and (E, H, I)
HF_STACKED_EXPERTS = {"gate_up_proj": "gate_up", "down_proj": "down"}


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

    @property
    def gguf_layer_names(self) -> dict[str, str]:
        """A layer's GGUF tensor names (after ``blk.{i}.``) -> the engine's."""
        return GGUF_LAYER_NAMES | self.gguf_names

    @property
    def gguf_whole_names(self) -> dict[str, str]:
        return GGUF_NAMES | self.gguf_global_names

    @property
    def hf_layer_names(self) -> dict[str, str]:
        """A layer's HF tensor names (after ``hf_layer_prefix`` and its index) -> the engine's."""
        return HF_LAYER_NAMES | self.hf_names

    @property
    def hf_whole_names(self) -> dict[str, str]:
        return HF_NAMES | self.hf_global_names


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
