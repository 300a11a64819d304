"""The runtime plan: every speed choice for one model on this machine, made from the flags, the file and the CPU
before the model is built, each with its reason (the start-up log, ``/health``): the dtype, the weight path
(``--dtype auto``'s weight plan from ``worker.autotune``, or the flags), the dense copies, the KV cache dtype, an
encoder's linear dtype, the block kernels' activation bits and the large-step weights. The model and its linears
are built from it (``layers.weights.LinearBuild``); nothing is set on a model afterwards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pagedllm.config import EngineConfig
from pagedllm.kernels import cpu_info
from pagedllm.layers.linear import runs_on_blocks
from pagedllm.layers.weights import LinearBuild
from pagedllm.model.arch import ModelArchConfig
from pagedllm.model.loader import load_model_files
from pagedllm.model.weights import CHECKPOINT_BLOCKS, load_weights
from pagedllm.quant.gguf_blocks import k_scaled
from pagedllm.quant.verdicts import BF16_DEFAULT, decide, default_for_blocks, start_sha256
from pagedllm.worker.autotune import WeightPlan, blocks_for_autotune, choose_plan, dense_copy_bytes, fit_to_steps

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# rows from which a step runs the layers on bfloat16 weight stripes (--large-step-weights bf16): on a CPU with AMX
# the stripes beat the block kernels from 128-256 rows on the 1.5B's shapes (docs/benchmarks.md)
BF16_STEP_MIN_TOKENS = 256
# Where the kernels have AMX-BF16 tiles (qlinear levels 0: the weights decoded to bfloat16 inside the kernel, the
# same numerics as the stripes, under the same verdict), steps from BF16_TILE_MIN_ROWS rows (by the weights' code
# bits) run on them and the stripes wait for BF16_TILES_STEP_MIN_TOKENS rows. Below those rows the int8 tiles' float
# step per block and row costs less than decoding each weight; above them oneDNN's GEMM on decoded stripes, which
# keeps the activations in cache, wins: from ~600 rows on the 1.5B's layers (~400 on the 0.5B's) with stripes of
# ``quant.linear.STRIPE_ROWS`` (Sapphire Rapids: docs/benchmarks.md)
BF16_TILE_MIN_ROWS = {4: 64, 8: 32}
BF16_TILES_STEP_MIN_TOKENS = 640


def choose_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    return torch.device(requested)


def choose_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[requested]


def activation_bits(requested: str, model_path: str, k_quants: bool) -> tuple[int, str]:
    """The block kernels' activation bits and why: as asked, or (auto) 8 where the file's quality verdict lets it
    (``quant.verdicts``: the user's recorded one, the shipped table, else the default, which takes 8 bits where
    every layer's blocks are ``k_quants``), else 16."""
    if requested != "auto":
        return int(requested), "as asked"
    v = decide(model_path, 8, "blocks", "8-bit activations", default_for_blocks(k_quants))
    return (8 if v.passed else 16), v.why


def large_step_weights(requested: str, model_path: str, bits: int) -> tuple[str, str]:
    """``blocks`` or ``bf16`` for the large steps, and why: as asked, or (auto) bf16 on a CPU with AMX-BF16 where
    the file's quality verdict on bf16 large steps with ``bits``-bit activations lets it (``quant.verdicts``)."""
    if requested != "auto":
        return requested, "as asked"
    if "amx_bf16" not in cpu_info()[1]:
        return "blocks", "no AMX-BF16 on this CPU"
    v = decide(model_path, bits, "bf16", f"bf16 large steps with {bits}-bit activations", BF16_DEFAULT)
    return ("bf16" if v.passed else "blocks"), v.why


def encoder_linear_dtype(flags: frozenset[str]) -> tuple[torch.dtype | None, str]:
    """An embedding model's ``--dtype auto`` on CPU, and why: float32 activations (residual stream, norms,
    attention), with the linears' weights and GEMMs in bfloat16 where the CPU has bfloat16 dot products (the
    vectors stay within cosine 0.9999 of float32's: docs/benchmarks.md#embedding-models), else float32 throughout
    (None)."""
    if flags & {"avx512_bf16", "amx_bf16"}:
        return torch.bfloat16, ("float32 activations, bfloat16 linears: this CPU computes bfloat16 dot products "
                                "(vectors within cosine 0.9999 of float32's)")
    return None, "float32: this CPU has no bfloat16 dot products"


def choose_kv_dtype(requested: str, model_dtype: torch.dtype, measured_plan: bool) -> torch.dtype:
    """``--kv-cache-dtype``; auto: bfloat16 under the measured packed-weight plan of ``--dtype auto`` on CPU
    (decode attention reads half the bytes; passes ``pagedllm eval`` against float32, docs/benchmarks.md),
    otherwise the model's dtype (``--dtype float32`` stays the exact-HF reference)."""
    if requested != "auto":
        return DTYPES[requested]
    return torch.bfloat16 if measured_plan else model_dtype


def block_weights(weights: dict, block_ops, device: torch.device, layers_only: bool = False) -> list:
    """The stored weights that will run on the block kernels (``layers_only``: the layers' linears, not the
    embedding or LM head); a mixture of experts' router is no linear (it is dequantized)."""
    peek = getattr(weights, "peek", weights.get)  # a LazyWeights' value without decoding it
    names = [n for n in weights if not n.endswith(".router") and (n.startswith("layers.") or not layers_only)]
    return [w for n in names if runs_on_blocks(w := peek(n), block_ops, device)]


def k_quant_layers(weights: dict, block_ops, device: torch.device) -> bool:
    """Whether every layer linear that runs the block kernels holds GGUF K-quant blocks (two-level scales)."""
    ws = block_weights(weights, block_ops, device, layers_only=True)
    return bool(ws) and all(k_scaled(w) for w in ws)


@dataclass
class RuntimePlan:
    dtype: torch.dtype  # the activations' (and float weights') dtype
    kv_dtype: torch.dtype
    build: LinearBuild  # how the linears are built: policy, block kernels, dense copies, activation bits, steps
    quantization: str  # the weights' label (logs, metrics)
    weight_plan: WeightPlan | None = None  # --dtype auto's plan for a file of blocks (None: the flags')
    activation_bits: int | None = None  # None: no linear runs the block kernels
    large_step_weights: str | None = None  # "blocks" / "bf16"; None: no layer linear runs the block kernels
    reasons: dict[str, str] = field(default_factory=dict)  # why each auto choice was made


def load_and_plan(config: EngineConfig, path: str, device: torch.device, ops) -> tuple[ModelArchConfig, dict,
                                                                                         RuntimePlan]:
    """The model file's config and weights, and the plan they are built with. ``ops``: the fused CPU kernels
    (None: none on this device)."""
    c = config
    if "auto" in (c.activation_bits, c.large_step_weights) and path.endswith(".gguf"):
        start_sha256(path)  # the quality verdicts' key, hashed while the weights load
    dtype = choose_dtype(c.model.dtype, device)
    arch, weights, policy, quantization, weight_plan = _load(c, path, device, ops)
    if weight_plan is not None and not weight_plan.block_kernel:
        dtype, weight_plan = DTYPES[weight_plan.dense_dtype], None  # dense weights: the plain path
    reasons = {}
    if weight_plan is not None:  # auto: the measured plan (the weights stay the file's blocks)
        build = LinearBuild(None, ops, weight_plan.layer_dense_min_tokens, weight_plan.head_dense_min_tokens,
                            DTYPES[weight_plan.dense_dtype])
    else:
        # the file's blocks run the block kernel: --quantization gguf, or an HF directory's own (gpt-oss's MXFP4)
        # under --dtype auto
        blocks = c.quantization == "gguf" or (quantization == CHECKPOINT_BLOCKS and c.model.dtype == "auto")
        build = LinearBuild(policy, ops if blocks else None, c.quant_dense_min_tokens)
    plan = RuntimePlan(dtype, choose_kv_dtype(c.cache.kv_cache_dtype, dtype, weight_plan is not None), build,
                       quantization, weight_plan, reasons=reasons)
    if arch.encoder:
        if c.model.dtype == "auto" and device.type == "cpu":
            build.linear_dtype, reasons["dtype"] = encoder_linear_dtype(cpu_info()[1])
        return arch, weights, plan
    bits, reasons["activation_bits"] = activation_bits(c.activation_bits, path,
                                                       k_quant_layers(weights, build.block_ops, device))
    large, reasons["large_step_weights"] = large_step_weights(c.large_step_weights, path, bits)
    tiles = large == "bf16" and build.block_ops is not None and build.block_ops.bf16_tiles()
    build.act_bits, build.mid_step_min_rows = bits, BF16_TILE_MIN_ROWS if tiles else {}
    build.large_step_min_tokens = (0 if large != "bf16" else BF16_TILES_STEP_MIN_TOKENS if tiles
                                   else BF16_STEP_MIN_TOKENS)
    if block_weights(weights, build.block_ops, device):
        plan.activation_bits = bits
    if block_weights(weights, build.block_ops, device, layers_only=True):
        plan.large_step_weights = large
    return arch, weights, plan


def _load(c: EngineConfig, path: str, device: torch.device, ops):
    """Weights as the flags ask; with ``--dtype auto`` on CPU (no ``--quantization``, one rank, a GGUF of 4/8-bit
    blocks, kernels built) the path measured fastest here (``worker.autotune``). -> (arch, weights, policy, label,
    weight plan or None)."""
    auto = (c.model.dtype == "auto" and c.quantization is None and device.type == "cpu" and ops is not None
            and c.tensor_parallel_size == 1 and path.endswith(".gguf"))
    dense = None
    if auto:
        arch, weights = load_model_files(path, native=True, lazy=True)
        if not arch.encoder and blocks_for_autotune(weights, arch.num_layers):  # (an encoder: float weights)
            plan, notes = choose_plan(weights, arch.num_layers, ops), []
            if plan.block_kernel:  # the dense copies it may add: only those a step reaches, within the budget
                spec = c.speculative.num_speculative_tokens if c.speculative is not None else 0
                budget = c.scheduler.with_budget_for(c.model.max_model_len or arch.max_position)
                itemsize = DTYPES[plan.dense_dtype].itemsize
                plan, notes = fit_to_steps(plan, budget.max_num_batched_tokens, c.scheduler.max_num_seqs * (1 + spec),
                                           dense_copy_bytes(weights, arch.num_layers, itemsize),
                                           c.dense_copy_budget_mib * 2**20)
            logger.info("weight path (%s on this CPU): %s%s", plan.source, plan.describe(),
                        "".join(f"; {n}" for n in notes))
            if plan.block_kernel:
                return arch, weights, None, "gguf blocks (auto)", plan
            dense = plan  # dense weights in the plan's dtype: loaded below
        del weights
    return (*load_weights(path, c.quantization, block_kernel=ops is not None and c.quantization == "gguf"), dense)
