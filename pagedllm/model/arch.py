"""A model's shape: the architecture hyper-parameters every layer reads (``ModelArchConfig``), and how they split
over tensor-parallel ranks (``TPLayout``, ``tp_layout``). Pure data: no weights, no devices, no process groups."""

from __future__ import annotations

import hashlib
import math

from dataclasses import dataclass, field

from pagedllm.model.archs import ARCHS, HF_TYPES, GGUFMeta, hf_eos, hf_rope  # the registry: a module each


ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "swiglu_oai")
STATE_LAYER_TYPES = ("linear", "conv", "mamba")  # layers that keep a state per sequence instead of K/V


@dataclass(frozen=True)
class ModelArchConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_id: int | None
    vocab_fingerprint: str | None = None  # sha256 of the token strings, where the file lists them
    # the variants an architecture picks (the defaults are llama's); ``model.archs`` sets them per architecture
    qk_norm: bool = False  # RMSNorm over each q and k head before the rotary (qwen3, gemma3)
    # the MLP's activation: "silu", "gelu_tanh" (gemma), "gelu" (erf: bert) or "swiglu_oai" (gpt-oss's clamped SwiGLU)
    hidden_act: str = "silu"
    embed_scale: float | None = None  # embedding rows times this, rounded to the model dtype (gemma: sqrt(hidden))
    sandwich_norm: bool = False  # RMSNorm on the attention and MLP outputs too, before the residual add (gemma)
    norm_float32: bool = False  # RMSNorm's weight multiplies the normalized x in float32, rounded once (gemma)
    attn_scale: float | None = None  # the query scale (None: head_dim ** -0.5)
    sliding_window: int | None = None  # keys a sliding layer sees, its own token included
    # per layer "full", "sliding", "linear" (a Gated DeltaNet layer: recurrent state, no KV), "conv" (LFM2's short
    # convolution: its last inputs as state, no KV) or "mamba" (a Mamba-2 layer: Granite 4.0-H); empty: all "full"
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # rotary base of the sliding layers, without scaling (gemma3)
    no_rope_layers: tuple[int, ...] = ()  # layers whose q and k are not rotated (SmolLM3's NoPE layers)
    # Llama 4's attention temperature (Ministral 3): each query times 1 + scale * log(1 + floor(position / length))
    attn_temperature_scale: float = 0.0
    attn_temperature_length: int = 0
    # {"rope_type": "linear" | "llama3" | "factors" | "yarn", ...}: how the (full layers') rotary frequencies are scaled
    rope_scaling: dict | None = field(default=None, compare=False, hash=False)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    attn_softcap: float | None = None  # attention scores = cap * tanh(scores / cap), before the softmax (gemma 2)
    attn_sinks: bool = False  # a learned logit per query head in each softmax's denominator (gpt-oss)
    stop_token_ids: tuple[int, ...] = ()  # end-of-generation tokens besides eos (gemma's <end_of_turn>)
    pooling: str | None = None  # an embedding model's pooling ("mean", "cls", "last"): the file's, or its modules'
    # an encoder (an embedding model): every token attends to the whole text, both ways; no KV cache is kept
    # (bert; gemma3 with use_bidirectional_attention: EmbeddingGemma, whose sliding layers see +-window/2 tokens)
    encoder: bool = False
    type_vocab_size: int = 0  # bert's token-type (segment) embeddings
    # mixture of experts (qwen3moe, mixtral): every layer's MLP is num_experts experts of moe_intermediate_size,
    # num_experts_per_tok of them per token (softmax router, top-k, renormalised with norm_topk_prob)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # > 0: a gated shared expert beside the routed ones (Qwen 3.5 MoE)
    moe_beside_mlp: bool = False  # the experts beside a dense MLP of intermediate_size, each normalised (Gemma 4)
    moe_scoring: str = "softmax"  # "sigmoid": sigmoid scores, chosen with an expert bias (LFM2-MoE)
    moe_routed_scale: float = 1.0  # the chosen experts' weights times this
    first_dense_layers: int = 0  # the first layers' MLPs are dense ones of intermediate_size (LFM2-MoE)
    rotary_dim: int = 0  # dimensions of each q/k head the rotary turns (the first ones; 0: all of head_dim)
    attn_output_gate: bool = False  # attention output times sigmoid(a per-channel gate from q's projection) (qwen3.5)
    # Gated DeltaNet ("linear" layers: Qwen 3.5, Qwen3-Next): key/value heads and sizes, the short convolution's
    # kernel (also LFM2's "conv" and Mamba-2's "mamba" layers', whose weights carry it: the simulator sizes their
    # states from it), and whether the value heads are tiled over the key heads (llama.cpp's GGUF order: v head j
    # reads key head j % key heads) or grouped (HF's: j // (value heads / key heads))
    linear_num_k_heads: int = 0
    linear_num_v_heads: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    linear_conv_kernel: int = 0
    linear_v_tiled: bool = False
    # Gemma 4: the full layers' own head size and KV heads (0: head_dim / num_kv_heads, as the sliding layers'); the
    # last kv_shared_layers layers keep no K/V and attend over the K/V of the last earlier layer of their type;
    # v RMS-normalised per head (no weight); per-layer inputs (PLE): a second embedding of per_layer_input_size
    # values per layer and token, mixed into each layer's residual stream after its MLP
    global_head_dim: int = 0
    global_num_kv_heads: int = 0
    kv_shared_layers: int = 0
    attn_v_norm: bool = False
    per_layer_input_size: int = 0
    # Mamba-2 ("mamba" layers: Granite 4.0-H): heads of head_dim inner values, B/C groups, the state size per head
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0
    # Granite's multipliers: each block's output times residual_scale before its residual add; logits divided by
    # logit_scale
    residual_scale: float = 1.0
    logit_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r}; supported: {tuple(ARCHS)}")
        for name in ("layer_types", "stop_token_ids", "no_rope_layers"):  # lists from a JSON checkpoint header
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        if set(self.layer_types) - {"full", "sliding", *STATE_LAYER_TYPES}:
            raise ValueError(f"layer types must be 'full', 'sliding', 'linear', 'conv' or 'mamba', got "
                             f"{sorted(set(self.layer_types))}")
        if "linear" in self.layer_types and not (self.linear_num_k_heads and self.linear_num_v_heads and
                                                 self.linear_conv_kernel and
                                                 self.linear_num_v_heads % self.linear_num_k_heads == 0):
            raise ValueError("linear (Gated DeltaNet) layers need their head counts (value heads a multiple of key "
                             "heads) and convolution kernel")
        if "mamba" in self.layer_types and not (self.mamba_heads and self.mamba_head_dim and self.mamba_state and
                                                 self.mamba_groups and self.mamba_heads % self.mamba_groups == 0):
            raise ValueError("mamba layers need their heads (a multiple of the groups), head size and state size")
        if "sliding" in self.layer_types and any(t in STATE_LAYER_TYPES for t in self.layer_types):
            raise ValueError("sliding-window layers beside recurrent-state layers are not supported yet")
        if self.layer_types and all(t in STATE_LAYER_TYPES for t in self.layer_types):
            raise ValueError("at least one attention layer is needed")
        if self.rotary_dim and (self.rotary_dim > self.head_dim or self.rotary_dim % 2):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and at most head_dim {self.head_dim}")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{self.num_experts_per_tok} experts per token of {self.num_experts}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        if self.num_heads % self.num_kv_heads or self.num_heads % self.layer_kv_heads(self.num_layers - 1):
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.kv_shared_layers:
            if not 0 < self.kv_shared_layers < self.num_layers or self.hybrid_state:
                raise ValueError(f"{self.kv_shared_layers} KV-sharing layers of {self.num_layers} (with no "
                                 "recurrent-state layers) are not supported")
            for i in range(self.num_layers - self.kv_shared_layers, self.num_layers):
                if self.kv_source(i) < 0:
                    raise ValueError(f"layer {i} shares the K/V of an earlier {self._type(i)} layer, and there is none")

    def window(self, layer: int) -> int:
        """Keys layer ``layer`` attends to (0: all of the context)."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == "sliding" else 0

    def _type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "full"

    def layer_head_dim(self, layer: int) -> int:
        """Layer ``layer``'s head size (Gemma 4's full layers: their own)."""
        return self.global_head_dim if self.global_head_dim and self._type(layer) == "full" else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return (self.global_num_kv_heads if self.global_num_kv_heads and self._type(layer) == "full"
                else self.num_kv_heads)

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V layer ``layer`` attends over: itself, or for one of the last ``kv_shared_layers``
        the last earlier layer of its type that keeps its own (-1: none)."""
        first_shared = self.num_layers - self.kv_shared_layers
        if layer < first_shared:
            return layer
        kind = self._type(layer)
        return max((j for j in range(first_shared) if self._type(j) == kind), default=-1)

    def has_state(self, layer: int) -> bool:
        """A layer with a state per sequence instead of K/V: Gated DeltaNet ("linear"), LFM2's short convolution
        ("conv") or Mamba-2 ("mamba")."""
        return bool(self.layer_types) and self.layer_types[layer] in STATE_LAYER_TYPES

    @property
    def hybrid_state(self) -> bool:
        """Some layers keep a recurrent state per sequence (next to the attention layers' paged KV)."""
        return any(t in STATE_LAYER_TYPES for t in self.layer_types)

    def state_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.has_state(i)]

    def state_pools(self, layer: int) -> tuple[tuple[tuple[int, ...], bool], ...]:
        """Per sequence, (shape, float32?) of each state pool of state layer ``layer``, as its layer module sizes
        them from its weights (``state_shapes`` of ``layers.gated_deltanet`` / ``mamba2`` / ``short_conv``): the
        convolution's last K - 1 inputs (in the activations' dtype) and the recurrent state (float32)."""
        kind, k = self.layer_types[layer], self.linear_conv_kernel
        if kind == "linear":
            nv, dk, dv = self.linear_num_v_heads, self.linear_k_head_dim, self.linear_v_head_dim
            return ((2 * self.linear_num_k_heads * dk + nv * dv, k - 1), False), ((nv, dk, dv), True)
        if kind == "mamba":
            inner = self.mamba_heads * self.mamba_head_dim
            return (((inner + 2 * self.mamba_groups * self.mamba_state, k - 1), False),
                    ((self.mamba_heads, self.mamba_head_dim, self.mamba_state), True))
        if kind == "conv":
            return (((self.hidden_size, k - 1), False),)
        raise ValueError(f"layer {layer} ({kind}) keeps no state")

    def state_bytes_per_slot(self, act_bytes: int) -> int:
        """One sequence's states over every state layer: float32 recurrent states, ``act_bytes`` per value of the
        convolution inputs."""
        return sum(math.prod(shape) * (4 if f32 else act_bytes)
                   for i in self.state_layers() for shape, f32 in self.state_pools(i))

    def kv_groups(self) -> KVGroups:
        own = [None if self.has_state(i) or self.kv_source(i) != i else self.window(i) for i in range(self.num_layers)]
        return kv_groups(own, [self.kv_source(i) for i in range(self.num_layers)])

    def kv_width(self, kv_heads: int | None = None) -> int:
        """Values of K (or V) per token in a cache tensor: the widest layer's heads x head size (layers of
        narrower heads use a prefix of each token's row). ``kv_heads``: a tensor-parallel rank's share (uniform
        heads only)."""
        if kv_heads is not None:
            return kv_heads * self.head_dim
        return max(self.layer_kv_heads(i) * self.layer_head_dim(i) for i in range(self.num_layers)
                   if not self.has_state(i))


@dataclass(frozen=True)
class KVGroups:
    """How the layers share the paged KV cache (vLLM's hybrid allocator): layers that attend alike (all of the
    context, or the same sliding window) form groups of ``slots`` layers, each group with its own block table per
    request, so a sliding group can free the blocks that fell out of its window. Layer i keeps its K/V in cache
    tensor ``slot[i]``, at the blocks of group ``group[i]``; a block holds ``slots`` layers. A model without
    sliding layers (or with them everywhere) is one group of all its layers."""

    group: tuple[int, ...]  # per layer (-1: a linear layer, no KV)
    slot: tuple[int, ...]  # per layer (-1: a linear layer)
    windows: tuple[int, ...]  # per group: 0 (full attention) or the window in tokens

    @property
    def slots(self) -> int:
        return max(self.slot) + 1

    @property
    def hybrid(self) -> bool:
        return any(self.windows)


def kv_groups(windows: list[int | None], sources: list[int] | None = None) -> KVGroups:
    """Groups of equal size: the greatest common divisor of the layer counts of each kind (Gemma 3's 15 sliding
    and 3 full layers: 6 groups of 3); full-attention groups first. A None window: a layer without KV of its own
    (a linear layer: in no group; a layer sharing another's K/V, ``sources[i]``: that layer's group and slot)."""
    kinds = sorted(set(w for w in windows if w is not None))  # 0 (full) first
    counts = [windows.count(w) for w in kinds]
    size = math.gcd(*counts)
    group, slot, group_windows = [-1] * len(windows), [-1] * len(windows), []
    for w in kinds:
        base = len(group_windows)
        layers = [i for i, x in enumerate(windows) if x == w]
        group_windows += [w] * (len(layers) // size)
        for j, i in enumerate(layers):
            group[i], slot[i] = base + j // size, j % size
    for i, src in enumerate(sources or ()):
        if src != i:
            group[i], slot[i] = group[src], slot[src]
    return KVGroups(tuple(group), tuple(slot), tuple(group_windows))


@dataclass(frozen=True)
class TPLayout:
    """What rank ``rank`` of ``world_size`` holds."""

    rank: int
    world_size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    kv_head_start: int  # first KV head (of the whole model) this rank holds
    intermediate_size: int  # MLP channels on this rank
    vocab_per_rank: int  # rows of the (padded) vocabulary on each rank
    vocab_start: int  # first vocabulary id of this rank's slice

    @property
    def padded_vocab_size(self) -> int:
        return self.vocab_per_rank * self.world_size


def tp_layout(cfg: ModelArchConfig, world_size: int, rank: int = 0) -> TPLayout:
    """The per-rank sizes, or a ValueError naming the model's head counts and sizes when they do not divide."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad tensor-parallel rank {rank} of world size {world_size}")
    n, h, kv, inter = world_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    problems = []
    if cfg.num_experts and n > 1:
        problems.append("mixture-of-experts layers are not split over ranks yet")
    if cfg.hybrid_state and n > 1:
        problems.append("linear-attention (Gated DeltaNet) layers are not split over ranks yet")
    if (cfg.global_head_dim or cfg.global_num_kv_heads or cfg.kv_shared_layers or cfg.per_layer_input_size) and n > 1:
        problems.append("per-layer head shapes, shared K/V and per-layer inputs (Gemma 4) are not split over ranks yet")
    if h % n:
        problems.append(f"{h} query heads are not a multiple of {n}")
    if kv % n and n % kv:
        problems.append(f"{kv} KV heads are neither a multiple nor a divisor of {n}")
    if inter % n:
        problems.append(f"intermediate size {inter} is not a multiple of {n}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={n} does not divide the model ({cfg.arch}: {h} query heads, {kv} KV heads, "
            f"intermediate size {inter}, hidden size {cfg.hidden_size}): " + "; ".join(problems)
            + ". Query heads and the intermediate size must be multiples of the tensor-parallel size; KV heads a "
            "multiple of it, or a divisor of it (then they are replicated)."
        )
    if kv >= n:
        kv_local, kv_start = kv // n, rank * (kv // n)
    else:  # replicated: n // kv consecutive ranks share one KV head, the one their query heads use
        kv_local, kv_start = 1, rank // (n // kv)
    vocab_per_rank = -(-cfg.vocab_size // n)
    return TPLayout(rank, n, h // n, kv_local, kv_start, inter // n, vocab_per_rank, rank * vocab_per_rank)


# llama.cpp's ``{arch}.pooling_type`` (0: none, 4: rank are no embedding pooling)
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


def _max_int(v) -> int:
    """A GGUF value that may be a per-layer array: its largest entry."""
    return int(max(v)) if isinstance(v, (list, tuple)) or hasattr(v, "__len__") and not isinstance(v, str) else int(v)


def _gguf_common(meta: GGUFMeta) -> dict:
    """The hyper-parameters every architecture's GGUF metadata holds alike (llama.cpp's key names)."""
    kv = meta.kv
    hidden, n_head = int(kv("embedding_length")), int(kv("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens", None)
    eot = meta.get("tokenizer.ggml.eot_token_id", None)
    eos = meta.get("tokenizer.ggml.eos_token_id", None)
    return dict(
        arch=meta.arch,
        vocab_size=int(kv("vocab_size", len(tokens) if tokens is not None else 0)),
        hidden_size=hidden,
        num_layers=int(kv("block_count")),
        num_heads=n_head,
        num_kv_heads=_max_int(kv("attention.head_count_kv", n_head)),  # (LFM2: per layer, 0 on its conv layers)
        head_dim=int(kv("attention.key_length", hidden // n_head)),
        # (MoE-only: the experts'; Gemma 4: per layer, the KV-sharing layers' twice as wide)
        intermediate_size=_max_int(kv("feed_forward_length", kv("expert_feed_forward_length", 0))),
        rms_norm_eps=float(kv("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(kv("rope.freq_base", 10000.0)),
        max_position=int(kv("context_length", 2048)),
        tie_word_embeddings="output.weight" not in meta.tensor_names,
        attention_bias="blk.0.attn_q.bias" in meta.tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id", None),
        eos_token_id=eos,
        stop_token_ids=() if eot is None or eot == eos else (int(eot),),
        pooling=GGUF_POOLING.get(int(kv("pooling_type", 0))),
        vocab_fingerprint=hashlib.sha256("\n".join(tokens).encode()).hexdigest() if tokens else None,
    )


def _hf_common(hf: dict, arch: str) -> dict:
    """The hyper-parameters every HF ``config.json`` holds alike (an architecture's module reads per-layer-type
    rotary parameters itself)."""
    n_head = hf["num_attention_heads"]
    per_type = isinstance((hf.get("rope_parameters") or {}).get("full_attention"), dict)
    theta, scaling = (10000.0, None) if per_type else hf_rope(hf)
    eos, stops = hf_eos(hf)
    return dict(
        arch=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=n_head,
        num_kv_heads=hf.get("num_key_value_heads") or n_head,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
        intermediate_size=hf.get("intermediate_size") or hf.get("moe_intermediate_size", 0),  # (MoE-only: experts')
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=hf.get("attention_bias", False),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        stop_token_ids=stops,
    )


def _check_gguf_rotary(meta: GGUFMeta, cfg: ModelArchConfig, path: str) -> None:
    """Rotary variants the layers do not implement stop the load with their name, rather than run wrong."""
    dims = meta.kv("rope.dimension_count")
    if dims is not None and int(dims) != (cfg.rotary_dim or cfg.global_head_dim or cfg.head_dim):
        raise ValueError(f"{path}: partial rotary ({dims} of {cfg.head_dim} dimensions) is not supported")
    if "rope_factors_long.weight" in meta.tensor_names:
        raise ValueError(f"{path}: long-context rotary factors (longrope) are not supported")
    kind = meta.kv("rope.scaling.type")
    if kind not in (None, "none") and cfg.rope_scaling is None:
        raise ValueError(f"{path}: rope scaling {kind!r} is not supported for {cfg.arch}")


def config_from_gguf(meta: GGUFMeta, path: str = "") -> ModelArchConfig:
    """The architecture's hyper-parameters from a GGUF file's metadata (the common keys, then its module's own),
    rotary variants the layers lack refused. Read by the model loader and by the simulator (no torch here)."""
    if meta.arch not in ARCHS:
        raise ValueError(f"{path}: unsupported architecture {meta.arch!r}; supported: {tuple(ARCHS)}")
    cfg = ModelArchConfig(**_gguf_common(meta) | ARCHS[meta.arch].from_gguf(meta))
    _check_gguf_rotary(meta, cfg, path)
    return cfg


def config_from_hf(hf: dict) -> ModelArchConfig:
    """The architecture's hyper-parameters from an HF ``config.json`` (a multimodal one's text config), the common
    keys then its module's own."""
    model_type = hf.get("model_type")
    if model_type not in HF_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {tuple(HF_TYPES)}")
    spec = HF_TYPES[model_type]
    return ModelArchConfig(**_hf_common(hf, spec.name) | spec.from_hf(hf))
