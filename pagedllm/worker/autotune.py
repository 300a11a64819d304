"""The weight path of ``--dtype auto`` on CPU, chosen by measuring this model's own linear shapes on this CPU.

For a GGUF model whose weights are 4-/8-bit blocks, two ways to run a linear layer compete:

- ``block``: the file's blocks as they are, through the fused kernel ``qlinear`` (two-level int8 activations,
  integer dot products; 0.5-1 byte per weight read per step);
- ``dense-float32``: a float32 copy through torch's GEMM (4 bytes per weight; the exact-HF reference numbers).

Each is timed on one decoder layer's linears (x number of layers) and on the LM head at batch sizes 1..256. The
packed path serves small steps when it wins there; a dense copy is kept for steps of at least the batch size from
which it is faster (per group: the layers and the LM head), or none when it never is. A bfloat16 copy (oneDNN,
fast with AMX or AVX512-BF16) is not a candidate: used for prefill steps it changed business-set answers beyond
what ``pagedllm eval``'s quality gate allows; ``--dtype bfloat16`` still runs the whole model in bf16, and
``--large-step-weights`` (quality-gated per file) runs large steps on bfloat16 stripes decoded on the fly, which
keep no copy. The plan
is cached per CPU, model shapes, kernel source and torch version (``autotune.json`` in ``config.cache_dir()``),
so later starts skip the measurement; the start-up log and ``/health`` show it. Where the kernels have int8 dot
products (VNNI, AMX) nothing is measured unless ``pagedllm autotune`` asks: the blocks win at every size there
(``integer_dot_products``), so a first start is as quick as a later one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from pagedllm.config import cache_dir
from pagedllm.kernels import build_key, cpu_info, target_march
from pagedllm.layers.linear import DenseLinear
from pagedllm.quant.formats import QuantizedWeight, concat, dequantize_any, row_slice
from pagedllm.quant.gguf_blocks import LazyBlocks
from pagedllm.quant.linear import BlockQuantLinear

logger = logging.getLogger(__name__)

BATCH_SIZES = (1, 4, 16, 64, 256)
HEAD_ROWS = 32768  # rows of the LM head timed (scaled to all of them)
# A dense path (4-8x the packed weights' memory, alone or as a copy) only where it beats the blocks by this factor:
# a tie (a tiny model's sub-millisecond timings, or a busy machine's noise) keeps the packed weights alone.
DENSE_MARGIN = 0.9
CACHE_VERSION = 3  # 2: no bfloat16 candidate; 3: consistency-checked timings, the head timed on a slice


@dataclass(frozen=True)
class WeightPlan:
    """How the linears of a packed model run: packed blocks for small steps, an optional dense copy for steps of
    at least ``*_dense_min_tokens`` rows (0: no copy)."""

    block_kernel: bool
    layer_dense_min_tokens: int
    head_dense_min_tokens: int
    dense_dtype: str  # "float32" | "bfloat16"
    source: str  # "measured" | "cached"
    # per candidate, per batch size: milliseconds of one forward's linears (layers x num_layers) and of the head
    timings_ms: dict = field(default_factory=dict)

    def describe(self) -> str:
        def part(n: int) -> str:
            return f"packed blocks, {self.dense_dtype} copy from {n} rows" if n else "packed blocks at every size"

        return f"layers: {part(self.layer_dense_min_tokens)}; LM head: {part(self.head_dense_min_tokens)}"


def _cache_path() -> Path:
    return Path(cache_dir()) / "autotune.json"


def _time_ms(fn, x: torch.Tensor, min_s: float = 0.03, max_reps: int = 50) -> float:
    fn(x)  # warm-up (first-touch, oneDNN primitive creation)
    times = []
    t_end = time.perf_counter() + min_s
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() < t_end):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


# a layer's linears as checkpoints store them: attention (fused or not: phi3), the MLP (gate and up fused or not),
# a Gated DeltaNet's projections (qkv, z, beta, alpha in, out; Qwen3-Next's qkvz, ba), a shared expert's, a short
# convolution's or Mamba-2's (in_proj, out), Gemma 4's per-layer input (ple_gate, ple_out)
LAYER_LINEARS = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down", "z", "beta", "alpha", "out", "qkvz",
                 "ba", "shared.gate", "shared.up", "shared.down", "shared.gate_up", "in_proj", "ple_gate", "ple_out")


def _linear_names(weights: dict, num_layers: int) -> tuple[list[str], str]:
    """The names of every layer's linears (as the checkpoint stores them; a mixture of experts: every expert's)
    and of the LM head."""
    peek = getattr(weights, "peek", weights.get)  # a LazyWeights' value without decoding it
    experts = tuple(f"experts.{e}.{n}" for e in range(_num_experts(weights)) for n in ("gate", "up", "down"))
    return [f"layers.{i}.{n}" for i in range(num_layers) for n in LAYER_LINEARS + experts
            if peek(f"layers.{i}.{n}") is not None], "lm_head" if "lm_head" in weights else "embed"


def blocks_for_autotune(weights: dict, num_layers: int) -> bool:
    """Whether every linear of the model (and the LM head) is an integer weight the block kernel runs."""
    peek = getattr(weights, "peek", weights.get)
    layers, head = _linear_names(weights, num_layers)
    return all(isinstance(w := peek(n), (QuantizedWeight, LazyBlocks)) and w.group_size % 16 == 0
               and w.shape[1] % 32 == 0 for n in layers + [head])


def dense_copy_bytes(weights: dict, num_layers: int, itemsize: int = 4) -> tuple[int, int]:
    """Bytes of a dense copy (``itemsize`` bytes per weight: 4 for float32) of the layers' linears and of the LM
    head."""
    peek = getattr(weights, "peek", weights.get)
    layers, head = _linear_names(weights, num_layers)
    size = lambda n: itemsize * math.prod(peek(n).shape)  # noqa: E731
    return sum(size(n) for n in layers), size(head)


def _num_experts(weights: dict) -> int:
    return sum(1 for n in weights if n.startswith("layers.0.experts.") and n.endswith(".down"))


def _layer_weights(weights: dict) -> dict[str, QuantizedWeight]:
    """The first attention layer's linears, fused as the model fuses them (a mixture of experts: its first
    expert's MLP)."""
    i = next(i for i in range(len(weights)) if f"layers.{i}.o" in weights)  # (a hybrid's first may be recurrent)
    p = f"layers.{i}."
    mlp = p if f"{p}down" in weights else f"{p}experts.0."
    return {
        "qkv": weights[p + "qkv"] if p + "qkv" in weights else concat([weights[p + n] for n in ("q", "k", "v")],
                                                                       defer_codes=True),
        "o": weights[p + "o"],
        "gate_up": weights[mlp + "gate_up"] if mlp + "gate_up" in weights else concat(
            [weights[mlp + "gate"], weights[mlp + "up"]], defer_codes=True),
        "down": weights[mlp + "down"],
    }


def _candidates(w: QuantizedWeight, ops) -> dict:
    return {"block": BlockQuantLinear(w, None, torch.device("cpu"), torch.float32, ops),
            # as build_linear keeps it for large steps (MKL's GEMM). A plan of dense weights everywhere (dense
            # faster at every batch size, batch 1 included) would run dense_linear, faster than this at a few rows:
            # timing MKL there only keeps the blocks in a case that 4 bytes a weight against 0.5-1 never reach
            "dense-float32": DenseLinear(dequantize_any(w).contiguous(), large_steps=True)}


def inconsistent(per: dict) -> set[int]:
    """Batch sizes whose timing breaks what the arithmetic allows a linear: a step of more rows costs at least
    ~what a smaller one does (the same weights are read, more work is done) and at most proportionally more (the
    weights are read once per step). A point a busy machine inflated fails one of these against a neighbour; both
    of the pair are named (the other may be the one that is off)."""
    ms = sorted(per)
    bad: set[int] = set()
    for a, b in zip(ms, ms[1:]):
        ta, tb = per[a], per[b]
        if tb < 0.7 * ta or tb > 1.6 * ta * b / a:
            bad |= {a, b}
    return bad


def consistent(timings: dict) -> bool:
    """Whether the block kernel's curves (``{"layers"|"head": {candidate: {batch size: ms}}}``) pass
    ``inconsistent``; the dense curves are not checked: load only slows them, which can keep the packed blocks but
    never adds a copy (and a float32 GEMM's time may rightly grow faster than its rows: Gemma 3's head)."""
    return not any(inconsistent(cands["block"]) for group, cands in timings.items() if group != "consistent")


def measure(weights: dict, num_layers: int, ops, batch_sizes=BATCH_SIZES, timer=None, rounds: int = 4) -> dict:
    """{"layers"|"head": {candidate: {batch size: ms}}} for one forward's linears. Points of the block kernel's
    curves that are inconsistent (``inconsistent``) are measured again, up to ``rounds`` times, keeping each point's
    fastest time (load only ever adds time); ``"consistent"`` says whether they passed in the end. The dense curves
    are not checked: load only slows them, which can keep the packed blocks but never adds a copy."""
    timer = timer or _time_ms
    head = weights["lm_head"] if "lm_head" in weights else weights["embed"]
    # a large vocabulary's head is timed on a slice of its rows, scaled up (the time is linear in the rows): its
    # float32 candidate would otherwise hold ~4 bytes per weight of the whole head for the measurement
    head_scale = max(1.0, head.shape[0] / HEAD_ROWS)
    if head_scale > 1:
        head = row_slice(head, HEAD_ROWS)
    groups = {"layers": list(_layer_weights(weights).values()), "head": [head]}
    res: dict = {}
    for group, ws in groups.items():
        per: dict = {}
        lins = [_candidates(w, ops) for w in ws]
        xs = {m: [torch.randn(m, w.shape[1]) for w in ws] for m in batch_sizes}

        def point(name: str, m: int) -> float:
            ms = sum(timer(cand[name], x) for cand, x in zip(lins, xs[m]))
            return round(ms * (num_layers if group == "layers" else head_scale), 4)

        for name in lins[0]:
            per[name] = {m: point(name, m) for m in batch_sizes}
            if name != "block":  # not checked (``consistent``)
                continue
            for _ in range(rounds):
                bad = inconsistent(per[name])
                if not bad:
                    break
                for m in sorted(bad):
                    per[name][m] = min(per[name][m], point(name, m))
            if inconsistent(per[name]):
                logger.warning("weight path: %s timings of %s still inconsistent after %d re-measurements (a busy "
                               "machine?): %s", group, name, rounds, per[name])
        res[group] = per
    res["consistent"] = consistent(res)
    return res


def plan_from_timings(timings: dict, source: str) -> WeightPlan:
    """The block kernel unless a dense path is clearly faster (``DENSE_MARGIN``) at batch 1; then the fastest dense
    copy from the first measured batch size where it clearly beats the block kernel (each group separately)."""
    def threshold(per: dict) -> tuple[int, str]:
        dense = [n for n in per if n.startswith("dense-")]
        for m in sorted(per["block"]):
            best = min(dense, key=lambda n: per[n][m])
            if per[best][m] < DENSE_MARGIN * per["block"][m]:
                return m, best
        return 0, "dense-float32"

    if not timings.get("consistent", True):  # measured under load: the arithmetic's plan, no dense copy
        return arithmetic_plan("timings inconsistent", timings)
    layers, head = timings["layers"], timings["head"]
    best = min((n for n in layers if n.startswith("dense-")), key=lambda n: layers[n][1])
    if layers[best][1] < DENSE_MARGIN * layers["block"][1]:  # a dense path wins clearly even for one row
        return WeightPlan(False, 1, 1, best.removeprefix("dense-"), source, timings)
    lt, ld = threshold(layers)
    ht, hd = threshold(head)
    dense_dtype = ld if lt else hd
    return WeightPlan(True, lt, ht, dense_dtype.removeprefix("dense-"), source, timings)


def fit_to_steps(plan: WeightPlan, max_step_tokens: int, max_head_rows: int, copy_bytes: tuple[int, int] = (0, 0),
                 budget_bytes: int | None = None) -> tuple[WeightPlan, list[str]]:
    """The plan without the dense copies that no step of this engine reaches (they would hold their bytes for
    nothing: Gemma 3's float32 LM head is 640 MiB): the layers' copy when the step token budget is below its
    threshold, the head's when the rows a step's head computes (each sequence's last token, and its drafts) stay
    below its own. Prompt-logprob rows, which can exceed that, then run on the packed head as the sampled rows do
    (its 256-row slices cost 1.07x the float32 copy's time for Gemma 3 on a Xeon with AMX, 1.15x for SmolLM2).
    Then the copies that do not fit ``budget_bytes`` (``copy_bytes``: the layers' and the head's copy in bytes;
    the layers' copy, which serves every large step, is kept first). Returns the plan and a note per copy
    dropped."""
    notes, layer, head = [], plan.layer_dense_min_tokens, plan.head_dense_min_tokens
    if layer and layer > max_step_tokens:
        notes.append(f"no layer copy (from {layer} rows; steps hold at most {max_step_tokens} tokens)")
        layer = 0
    if head and head > max_head_rows:
        notes.append(f"no LM head copy (from {head} rows; a step's head computes at most {max_head_rows})")
        head = 0
    if budget_bytes is not None:
        def over(name: str, size: int, left: int) -> bool:
            if size > left:
                notes.append(f"no {name} copy ({size / 2**20:.0f} MiB of {plan.dense_dtype} over the "
                             f"{left / 2**20:.0f} MiB left of --dense-copy-budget-mib)")
            return size > left

        if layer and over("layer", copy_bytes[0], budget_bytes):
            layer = 0
        if head and over("LM head", copy_bytes[1], budget_bytes - (copy_bytes[0] if layer else 0)):
            head = 0
    return replace(plan, layer_dense_min_tokens=layer, head_dense_min_tokens=head), notes


def cache_key(weights: dict, num_layers: int, isa: str) -> str:
    model, flags = cpu_info()
    shapes = sorted((k, tuple(w.shape), w.bits, w.group_size) for k, w in _layer_weights(weights).items())
    peek = getattr(weights, "peek", weights.get)  # the head's shape and format, without decoding it
    head = peek("lm_head") if "lm_head" in weights else peek("embed")
    h = hashlib.sha256(json.dumps([CACHE_VERSION, model, sorted(flags), os.cpu_count(), torch.get_num_threads(),
                                   torch.__version__, build_key(target_march()), isa, shapes, num_layers,
                                   [tuple(head.shape), head.bits, head.group_size]]).encode())
    return h.hexdigest()[:16]


def integer_dot_products(isa: str) -> bool:
    """Whether the block kernel's build has int8 dot-product instructions (AVX512-VNNI, AVX-VNNI, AMX-INT8). Then a
    dense float32 copy cannot beat the blocks by ``DENSE_MARGIN`` at any step size: the blocks read 0.5-1 byte per
    weight against its 4, and a VNNI instruction does 64 int8 products where an FMA does 16 float32 ones (measured
    on Zen 4 and on Sapphire Rapids: every model's plan kept no copy, docs/benchmarks.md "Start-up")."""
    return "vnni" in isa or "amx" in isa


def arithmetic_plan(why: str, timings: dict | None = None) -> WeightPlan:
    """Packed blocks at every step size, no dense copy."""
    return WeightPlan(True, 0, 0, "float32", f"arithmetic ({why})", timings or {})


def choose_plan(weights: dict, num_layers: int, ops, remeasure: bool = False, measure_here: bool = False) -> WeightPlan:
    """The cached plan for this CPU and model shapes, else the arithmetic's where the kernels have integer dot
    products (``integer_dot_products``: a first start measures nothing), else a new measurement (a few seconds),
    cached. A cached entry whose timings are inconsistent is measured again; ``remeasure``: measure again in any
    case; ``measure_here``: measure where nothing is cached, whatever the instructions (``pagedllm autotune``)."""
    isa = ops.isa()
    key = cache_key(weights, num_layers, isa)  # "+amx" or not: the block kernel's speed differs
    path = _cache_path()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached.get(key), dict):
        try:  # JSON keeps the batch sizes as strings
            timings = {g: {c: {int(m): float(t) for m, t in per.items()} for c, per in cands.items()}
                       for g, cands in cached[key].items() if g != "consistent"}
            checked = "consistent" in cached[key]  # this version checked it (an inconsistent one: the arithmetic)
            # from the block curves, not the stored flag (which older versions also set on a dense curve)
            timings["consistent"] = consistent(timings)
            if (checked or timings["consistent"]) and not remeasure:
                return plan_from_timings(timings, "cached")
            # an unchecked plan (an older version cached it) that fails the checks: measure again
        except (KeyError, TypeError, ValueError):
            pass  # a stale or damaged entry: measure again
    if not remeasure and not measure_here and integer_dot_products(isa):
        return arithmetic_plan(f"int8 dot products ({isa}): the blocks at every size")
    t = time.perf_counter()
    timings = measure(weights, num_layers, ops)
    logger.info("weight path measured in %.1f s", time.perf_counter() - t)
    cached[key] = timings
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not cache the weight-path measurement in %s: %s", path, e)
    return plan_from_timings(timings, "measured")


def plan_summary(plan: WeightPlan) -> dict:
    d = asdict(plan)
    d["description"] = plan.describe()
    return d
