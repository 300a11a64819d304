"""Model shapes (presets, a HuggingFace ``config.json``, or a GGUF header) and weight bytes per quantization."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import MappingProxyType

from pagedllm.gguf_file import BLOCK_TYPES, GGUFFile
from pagedllm.model.arch import KVGroups, ModelArchConfig, config_from_gguf, config_from_hf, tp_layout
from pagedllm.model.archs import GGUFMeta
from pagedllm.sim.hardware import COMPUTE_DTYPES


@dataclass(frozen=True)
class LinearGroup:
    """One kind of linear the layers hold: ``layers`` of them, each ``copies`` matrices of in x out (the experts of a
    mixture; 1: dense), of which a token multiplies ``active`` (its top-k experts). ``name`` sets the
    tensor-parallel split: "o" and "mlp_down" by their inputs, the others by their outputs."""

    name: str
    in_features: int
    out_features: int
    layers: int
    copies: int = 1
    active: int = 1

    @property
    def params(self) -> int:
        return self.in_features * self.out_features * self.copies * self.layers

    def touched(self, rows: int) -> float:
        """Matrices per layer a step of ``rows`` rows reads: all of a dense one; of the experts, those some row
        chose (expected under uniform routing)."""
        if self.copies == 1:
            return 1.0
        return self.copies * (1.0 - (1.0 - self.active / self.copies) ** rows)


@dataclass(frozen=True)
class ModelProfile:
    """A model the simulator runs: the engine's own reading of its shapes (``ModelArchConfig``, from the same
    parser the loader uses: its layer windows, per-layer head shapes, shared K/V and KV layout included), a name, and
    the tensor formats of the GGUF file it was read from. The cost model knows attention layers (grouped-query, any
    head shape per layer, sliding windows, K/V shared across layers), gated MLPs, mixtures of experts (the
    active experts' FLOPs, the chosen experts' bytes) and layers with a recurrent state per sequence instead of K/V
    (Gated DeltaNet, Mamba-2, LFM2's short convolution: their projections, the recurrence's FLOPs per token, the
    state read and written once per sequence and step, the state slots' memory)."""

    name: str
    arch: ModelArchConfig
    gguf_scheme: "QuantScheme | None" = None  # the tensor formats of the GGUF file this profile was read from

    num_layers = property(lambda self: self.arch.num_layers)
    hidden_size = property(lambda self: self.arch.hidden_size)
    num_heads = property(lambda self: self.arch.num_heads)
    num_kv_heads = property(lambda self: self.arch.num_kv_heads)
    head_dim = property(lambda self: self.arch.head_dim)
    intermediate_size = property(lambda self: self.arch.intermediate_size)
    vocab_size = property(lambda self: self.arch.vocab_size)
    tie_word_embeddings = property(lambda self: self.arch.tie_word_embeddings)
    max_position = property(lambda self: self.arch.max_position)
    attention_bias = property(lambda self: self.arch.attention_bias)

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per layer, the keys it attends to (0: all of the context; a sliding window in tokens)."""
        return tuple(self.arch.window(i) for i in range(self.num_layers))

    @property
    def kv_layout(self) -> KVGroups:
        """How the layers share the paged KV cache: the engine's own grouping (``ModelArchConfig.kv_groups``),
        sliding groups freeing the blocks that fell out of their window, layers reading another's K/V keeping
        none."""
        return self.arch.kv_groups()

    def kv_width(self, tp: int = 1) -> int:
        """K (or V) values per token and layer in one device's cache, as the engine sizes it: the widest layer's
        heads x head size (narrower layers use a prefix of it); under tensor parallelism a rank's KV heads
        (``tp_layout``: replicated where tp exceeds them; its refusals stand)."""
        return self.arch.kv_width(tp_layout(self.arch, tp).num_kv_heads if tp > 1 else None)

    def kv_layers(self) -> list[int]:
        """The layers that keep K/V of their own."""
        return [i for i in range(self.num_layers) if self.arch.kv_source(i) == i and not self.arch.has_state(i)]

    def state_layers(self) -> list[int]:
        """The layers that keep a recurrent state per sequence instead of K/V."""
        return self.arch.state_layers()

    def state_bytes_per_slot(self, act_bytes: int) -> int:
        """One sequence's recurrent states over every state layer (the engine's slot: ``ModelArchConfig``)."""
        return self.arch.state_bytes_per_slot(act_bytes)

    def state_flops_per_token(self) -> float:
        """The recurrences' FLOPs per token, over the state layers, outside their projections: Gated DeltaNet per
        value head the decay, S k, the rank-1 update and S q over its Dk x Dv state (~7 Dk Dv); Mamba-2 per head
        the decay, the x B update and C S over its P x N state (~5 P N); every layer its convolution (2 K per
        channel) and gates."""
        a, out = self.arch, 0.0
        for i in self.state_layers():
            channels, history = a.state_pools(i)[0][0]  # the convolution's pool: (channels, K - 1)
            out += 2 * channels * (history + 1)
            if a.layer_types[i] == "linear":
                out += 7 * a.linear_num_v_heads * a.linear_k_head_dim * a.linear_v_head_dim
            elif a.layer_types[i] == "mamba":
                out += 5 * a.mamba_heads * a.mamba_head_dim * a.mamba_state
            else:  # LFM2's gated short convolution: B * x, then C * the convolution
                out += 2 * self.hidden_size
        return out

    def kv_token_layers(self, seq_len: int) -> int:
        """Layer-tokens of K/V a sequence of ``seq_len`` tokens keeps: all of them in a full layer, at most its
        window in a sliding one, none in a layer reading another's."""
        windows = self.layer_windows
        return sum(min(seq_len, windows[i]) if windows[i] else seq_len for i in self.kv_layers())

    def attention_layers(self) -> list[tuple[int, int]]:
        """(window, query heads x head size) of every attention layer (those reading another's K/V included)."""
        a = self.arch
        return [(a.window(i), a.num_heads * a.layer_head_dim(i)) for i in range(self.num_layers) if not a.has_state(i)]

    def linear_groups(self) -> tuple[LinearGroup, ...]:
        """The layers' linears, alike ones counted together."""
        a, h = self.arch, self.hidden_size
        counts: dict[tuple, int] = {}
        for i in range(self.num_layers):
            kinds = self._mixer_linears(i)
            experts = a.num_experts and i >= a.first_dense_layers
            if not experts or a.moe_beside_mlp:
                kinds += [("mlp_up", h, 2 * a.intermediate_size, 1, 1), ("mlp_down", a.intermediate_size, h, 1, 1)]
            if experts:
                e, k, inter = a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size
                kinds += [("router", h, e, 1, 1), ("mlp_up", h, 2 * inter, e, k), ("mlp_down", inter, h, e, k)]
                if a.shared_expert_intermediate_size:
                    shared = a.shared_expert_intermediate_size
                    kinds += [("mlp_up", h, 2 * shared, 1, 1), ("mlp_down", shared, h, 1, 1)]
            if a.per_layer_input_size:  # Gemma 4's per-layer input: its gate and output projection
                kinds += [("ple_gate", h, a.per_layer_input_size, 1, 1), ("ple_out", a.per_layer_input_size, h, 1, 1)]
            for kind in kinds:
                counts[kind] = counts.get(kind, 0) + 1
        if a.per_layer_input_size:  # the model's projection of the hidden state to every layer's inputs, once
            counts[("ple_proj", h, self.num_layers * a.per_layer_input_size, 1, 1)] = 1
        return tuple(LinearGroup(name, i, o, n, c, k) for (name, i, o, c, k), n in counts.items())

    def _mixer_linears(self, i: int) -> list[tuple]:
        """Layer i's linears before its MLP, as (name, in, out, copies, active): an attention layer's q/k/v (with
        Qwen 3.5's output gate, a second q's width) and output projection; a state layer's input projection (Gated
        DeltaNet: the convolved q/k/v, z, b and a; Mamba-2: z, x/B/C and dt; a short convolution: B, C, x) and
        output projection."""
        a, h = self.arch, self.hidden_size
        kind = a.layer_types[i] if a.layer_types else "full"
        if kind == "linear":
            nv, value = a.linear_num_v_heads, a.linear_num_v_heads * a.linear_v_head_dim
            conv = a.state_pools(i)[0][0][0]
            return [("state_in", h, conv + value + 2 * nv, 1, 1), ("state_out", value, h, 1, 1)]
        if kind == "mamba":
            inner = a.mamba_heads * a.mamba_head_dim
            return [("state_in", h, 2 * inner + 2 * a.mamba_groups * a.mamba_state + a.mamba_heads, 1, 1),
                    ("state_out", inner, h, 1, 1)]
        if kind == "conv":
            return [("state_in", h, 3 * h, 1, 1), ("state_out", h, h, 1, 1)]
        d = a.layer_head_dim(i)
        q, kv = a.num_heads * d, (2 * a.layer_kv_heads(i) * d if a.kv_source(i) == i else 0)
        return [("qkv", h, q * (2 if a.attn_output_gate else 1) + kv, 1, 1), ("o", q, h, 1, 1)]

    @property
    def linear_params(self) -> int:
        """Every layer's linear weights (all experts)."""
        return sum(g.params for g in self.linear_groups())

    @property
    def active_linear_params(self) -> int:
        """The layers' weights one token multiplies (its experts only)."""
        return sum(g.in_features * g.out_features * g.active * g.layers for g in self.linear_groups())

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def per_layer_input_params(self) -> int:
        """Gemma 4's per-layer input table: per token, a row of per_layer_input_size values for every layer."""
        return self.vocab_size * self.num_layers * self.arch.per_layer_input_size

    @property
    def num_params(self) -> int:
        """Every parameter: linears, q/k/v biases, norms, embedding, and the LM head unless tied."""
        groups = self.linear_groups()
        per_model = self.linear_params + 2 * self.hidden_size * self.num_layers
        if self.attention_bias:
            per_model += sum(g.out_features * g.layers for g in groups if g.name == "qkv")
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return per_model + self.embedding_params + self.per_layer_input_params + head + self.hidden_size


# ------------------------------------------------------------------ weight formats
@dataclass(frozen=True)
class WeightFormat:
    """How one weight matrix is stored: bytes per weight including scales/zeros, and how its matmul computes."""

    name: str
    bytes_per_weight: float
    compute_dtype: str  # "bf16", "fp8", "int8" (W8A8 / integer block kernels), "fp32"
    compute_factor: float = 1.0  # attainable GEMM throughput relative to that dtype's (dequantizing kernels < 1)
    per_channel_bytes: int = 0  # extra bytes per output channel (per-channel scales)

    def __post_init__(self) -> None:
        if not self.bytes_per_weight > 0 or self.per_channel_bytes < 0:
            raise ValueError(f"weight format {self.name}: bytes must be positive")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"weight format {self.name}: compute_dtype must be one of {COMPUTE_DTYPES}")
        if not 0 < self.compute_factor <= 1:
            raise ValueError(f"weight format {self.name}: compute_factor must be in (0, 1]")

    def matrix_bytes(self, in_features: int, out_features: int) -> float:
        return in_features * out_features * self.bytes_per_weight + out_features * self.per_channel_bytes


def _gguf_block(name: str, block: int, type_size: int, compute: str = "int8") -> WeightFormat:
    return WeightFormat(name, type_size / block, compute)


# AWQ / GPTQ 4-bit, group 128: 0.5 byte per weight + per group an fp16 scale and a 4-bit zero (2.5 bytes / 128).
# Their GEMM dequantizes in the kernel and computes in fp16/bf16; at large batch such kernels reach less than a
# dense cuBLAS GEMM (assumed 0.75 of it; uncalibrated).
_GROUP = 128
FORMATS = MappingProxyType({
    "fp32": WeightFormat("fp32", 4.0, "fp32"),
    "bf16": WeightFormat("bf16", 2.0, "bf16"),
    "fp8": WeightFormat("fp8", 1.0, "fp8", per_channel_bytes=4),
    "int8": WeightFormat("int8", 1.0, "int8", per_channel_bytes=4),
    "awq4": WeightFormat("awq4", 0.5 + 2.5 / _GROUP, "bf16", compute_factor=0.75),
    "gptq4": WeightFormat("gptq4", 0.5 + 2.5 / _GROUP, "bf16", compute_factor=0.75),
    # GGUF block types (``gguf_file.BLOCK_TYPES``: their bytes per block of values), on the integer block kernels
    **{name.lower(): _gguf_block(name.lower(), t.values, t.nbytes) for name, t in BLOCK_TYPES.items()},
})


@dataclass(frozen=True)
class QuantScheme:
    """The format of the decoder layers' linears, the embedding table and the LM head."""

    name: str
    linear: WeightFormat
    embed: WeightFormat
    head: WeightFormat
    norm_bytes: int = 4  # norms stay in full precision

    def weight_bytes(self, m: ModelProfile) -> dict[str, float]:
        """Bytes of the whole model (before tensor-parallel sharding), per part."""
        groups = m.linear_groups()
        layers = sum(self.linear.matrix_bytes(g.in_features, g.out_features) * g.copies * g.layers for g in groups)
        if m.attention_bias:
            layers += sum(g.out_features * g.layers for g in groups if g.name == "qkv") * 2
        embed = self.embed.matrix_bytes(m.hidden_size, m.vocab_size)
        if m.per_layer_input_params:  # (Gemma 4's per-layer input table: stored as the embedding is)
            embed += self.embed.matrix_bytes(m.num_layers * m.arch.per_layer_input_size, m.vocab_size)
        head = 0.0 if m.tie_word_embeddings else self.head.matrix_bytes(m.hidden_size, m.vocab_size)
        norms = (2 * m.num_layers + 1) * m.hidden_size * self.norm_bytes
        return {"layers": layers, "embed": embed, "lm_head": head, "norms": norms}

    def total_bytes(self, m: ModelProfile) -> float:
        return sum(self.weight_bytes(m).values())

    def head_format(self, m: ModelProfile) -> WeightFormat:
        """What the LM head reads: the embedding table when tied."""
        return self.embed if m.tie_word_embeddings else self.head


def _scheme(name: str, linear: str, embed: str = "bf16", head: str | None = None) -> QuantScheme:
    return QuantScheme(name, FORMATS[linear], FORMATS[embed], FORMATS[head or embed])


# GPU checkpoints keep the embedding and LM head in bf16 (as AWQ/GPTQ/FP8 checkpoints usually do); GGUF files
# keep them in 8-bit blocks (SmolLM2's Q4_1 file: Q8_0 embedding, tied head).
SCHEMES = MappingProxyType({
    "bf16": _scheme("bf16", "bf16"),
    "fp8": _scheme("fp8", "fp8"),
    "int8": _scheme("int8", "int8"),
    "awq": _scheme("awq", "awq4"),
    "gptq": _scheme("gptq", "gptq4"),
    "q4_0": _scheme("q4_0", "q4_0", "q8_0"),
    "q4_1": _scheme("q4_1", "q4_1", "q8_0"),
    "q8_0": _scheme("q8_0", "q8_0", "q8_0"),
})


def get_scheme(name: str, model: ModelProfile | None = None) -> QuantScheme:
    """A named scheme; ``gguf`` means the formats of the GGUF file the model profile was read from."""
    key = name.lower()
    if key == "gguf":
        if model is None or model.gguf_scheme is None:
            raise ValueError("quantization 'gguf' needs a model read from a .gguf file")
        return model.gguf_scheme
    if key not in SCHEMES:
        raise ValueError(f"unknown quantization {name!r}; known: {sorted(SCHEMES) + ['gguf']}")
    return SCHEMES[key]


# ------------------------------------------------------------------ presets (published configs)
def _preset(name: str, arch: str, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
            vocab: int, tied: bool, max_position: int, bias: bool = False,
            scheme: "QuantScheme | None" = None) -> ModelProfile:
    return ModelProfile(name, ModelArchConfig(
        arch=arch, vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=hidden // heads, intermediate_size=intermediate, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position=max_position, tie_word_embeddings=tied, attention_bias=bias, bos_token_id=None,
        eos_token_id=None), scheme)


_PRESETS = (
    _preset("llama-3-8b", "llama", 32, 4096, 32, 8, 14336, 128256, False, 8192),
    _preset("llama-3-70b", "llama", 80, 8192, 64, 8, 28672, 128256, False, 8192),
    _preset("qwen2.5-7b", "qwen2", 28, 3584, 28, 4, 18944, 152064, False, 32768, bias=True),
    _preset("qwen2.5-72b", "qwen2", 80, 8192, 64, 8, 29568, 152064, False, 32768, bias=True),
    # the embedded default model: SmolLM2-135M-Instruct.Q4_1.gguf
    _preset("smollm2-135m", "llama", 30, 576, 9, 3, 1536, 49152, True, 8192, scheme=SCHEMES["q4_1"]),
)
PRESETS = MappingProxyType({p.name: p for p in _PRESETS})


def from_hf_config(path: str) -> ModelProfile:
    """A HuggingFace ``config.json`` (or the directory holding it), read as the model loader reads it."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        c = json.load(f)
    if "text_config" in c:  # multimodal wrappers keep the language model's config inside
        c = {"model_type": c.get("model_type")} | c["text_config"]  # the text model's own type where it says
    name = c.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf-model"
    return ModelProfile(name, config_from_hf(c))  # (the model loader's own reading of the checkpoint)


def _gguf_format(type_name: str, block: int, type_size: int) -> WeightFormat:
    key = type_name.lower()
    if key in FORMATS:  # the block types pagedllm runs, and the float ones
        return FORMATS[key]
    if key in ("f16", "bf16"):
        return FORMATS["bf16"]
    if key == "f32":
        return FORMATS["fp32"]
    return _gguf_block(key, block, type_size)  # a type outside the table: gguf's block size, integer kernels


def from_gguf(path: str) -> ModelProfile:
    """Shapes from a GGUF header (``pagedllm.gguf_file``; numpy only), read as the model loader reads them
    (``model.arch.config_from_gguf``), and the file's tensor formats: the format holding most bytes of the decoder
    layers' linears, and those of the embedding and the output head."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    reader = GGUFFile(path)
    by_name = {t.name: t for t in reader.tensors}
    meta = GGUFMeta(reader.get("general.architecture"), reader.get, set(by_name),
                    lambda n: dequantize(by_name[n].data, by_name[n].tensor_type).astype("float32"))
    if meta.arch is None:
        raise ValueError(f"{path}: no general.architecture in the GGUF header")
    layer_bytes: dict[str, float] = {}
    fmt_of: dict[str, WeightFormat] = {}
    for t in reader.tensors:
        ttype = t.tensor_type
        block, type_size = GGML_QUANT_SIZES[ttype]
        fmt = _gguf_format(ttype.name, block, type_size)
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) in (2, 3):  # (3: experts)
            layer_bytes[fmt.name] = layer_bytes.get(fmt.name, 0.0) + int(t.n_bytes)
            fmt_of[fmt.name] = fmt
        elif t.name == "token_embd.weight":
            fmt_of["__embed"] = fmt
        elif t.name == "output.weight":
            fmt_of["__head"] = fmt
    if not layer_bytes:
        raise ValueError(f"{path}: no decoder-layer weight matrices found")
    linear = fmt_of[max(layer_bytes, key=layer_bytes.get)]
    embed = fmt_of.get("__embed", FORMATS["bf16"])
    head = fmt_of.get("__head", embed)
    return ModelProfile(str(reader.get("general.name") or os.path.basename(path)), config_from_gguf(meta, path),
                        QuantScheme(f"gguf:{linear.name}", linear, embed, head))


def load_model_profile(spec: str) -> ModelProfile:
    """A preset name, a ``.gguf`` file, or a ``config.json`` / HuggingFace directory."""
    key = spec.lower()
    if key in PRESETS:
        return PRESETS[key]
    if spec.endswith(".gguf") and os.path.isfile(spec):
        return from_gguf(spec)
    if os.path.isdir(spec) or (os.path.isfile(spec) and spec.endswith(".json")):
        return from_hf_config(spec)
    raise ValueError(f"unknown model {spec!r}: give a preset ({sorted(PRESETS)}), a .gguf file, or a config.json "
                     "/ HuggingFace directory")


def human_bytes(n: float) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n:.0f} B"


def human_count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
