"""The roofline cost of one engine step, and the memory plan that sets the KV cache's capacity.

Per op group (the decoder layers' QKV, O and MLP linears; attention over each sequence's context; the embedding
lookups; the LM head, only for rows that sample), time = max(FLOPs / attainable FLOP/s, bytes / attainable
bandwidth), with everything divided across the tensor-parallel group; the step adds two all-reduces per layer
(ring: 2(t-1)/t x bytes / link bandwidth + 2(t-1) hop latencies), an all-gather of the sampled rows' logits, and
fixed overheads per step, per sequence and per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pagedllm.config import state_slots
from pagedllm.sim.hardware import HardwareProfile
from pagedllm.sim.kvcalc import kv_dtype_bytes
from pagedllm.model.arch import KVGroups, tp_layout
from pagedllm.sim.model_profile import ModelProfile, QuantScheme


@dataclass(frozen=True)
class Deployment:
    """A model in one number format on a tensor-parallel group of identical devices."""

    hardware: HardwareProfile
    model: ModelProfile
    scheme: QuantScheme
    tp: int = 1
    kv_dtype: str = ""  # "": the hardware's default (bf16 on GPU; a calibrated CPU's: what its roofline run used)
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int | None = None  # fixed KV pool per device (the CPU engine's --kv-cache-memory)
    activation_reserve_bytes: int | None = None  # None: the hardware profile's

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tensor-parallel size must be a positive integer, got {self.tp!r}")
        if self.model.num_heads % self.tp:
            raise ValueError(f"{self.model.name}: {self.model.num_heads} attention heads do not split over "
                             f"tp={self.tp}")
        if self.model.intermediate_size % self.tp:
            raise ValueError(f"{self.model.name}: intermediate size {self.model.intermediate_size} does not split "
                             f"over tp={self.tp}")
        if self.tp > 1:  # what the engine splits over ranks, or its refusal (mixtures of experts, Gemma 4's shapes...)
            tp_layout(self.model.arch, self.tp)
        if not self.kv_dtype:
            object.__setattr__(self, "kv_dtype", self.hardware.default_kv_dtype)
        kv_dtype_bytes(self.kv_dtype)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be > 0")
        if self.activation_reserve_bytes is not None and self.activation_reserve_bytes < 0:
            raise ValueError("activation_reserve_bytes must be >= 0")

    @property
    def num_devices(self) -> int:
        return self.tp

    @property
    def weight_bytes(self) -> float:
        return self.scheme.total_bytes(self.model)

    @property
    def weight_bytes_per_device(self) -> float:
        return self.weight_bytes / self.tp

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K and V of one token in one layer, on one device: the cache row (the widest layer's)."""
        return 2 * self.model.kv_width(self.tp) * kv_dtype_bytes(self.kv_dtype)

    @property
    def kv_bytes_per_token_device(self) -> int:
        """K and V of one token in every layer that keeps its own, on one device (a full-attention figure)."""
        return self.kv_bytes_per_token_layer * len(self.model.kv_layers())

    def kv_bytes_per_block(self, block_size: int = 16) -> int:
        """One KV block on one device: ``block_size`` tokens of the layers one block holds (the engine's layout,
        ``ModelProfile.kv_layout``: all the layers, or a group's where sliding and full layers keep separate
        block tables)."""
        return block_size * self.kv_bytes_per_token_layer * self.model.kv_layout.slots

    @property
    def state_bytes_per_slot(self) -> int:
        """A hybrid model's recurrent states of one sequence (0: no state layers): float32 states, the
        convolutions' inputs in the activations' dtype, as the engine's pools (``config.state_slots``)."""
        return self.model.state_bytes_per_slot(self.hardware.activation_bytes) if self.model.state_layers() else 0

    def memory_plan(self, block_size: int = 16, max_num_seqs: int = 64, prefix_caching: bool = True) -> "MemoryPlan":
        """Weights, the activation reserve, a hybrid model's state slots (as many as the engine keeps for
        ``max_num_seqs`` sequences, ``config.state_slots``) and the KV pool in what is left (or the fixed
        ``kv_cache_bytes``, the state slots beside it as on the CPU engine, within memory)."""
        hw = self.hardware
        reserve = self.activation_reserve_bytes
        if reserve is None:
            reserve = hw.activation_reserve_bytes
        budget = hw.memory_bytes * self.gpu_memory_utilization
        slots = live = 0
        if self.state_bytes_per_slot:
            slots, live = state_slots(self.state_bytes_per_slot, max_num_seqs, prefix_caching)
        left = budget - self.weight_bytes_per_device - reserve - slots * self.state_bytes_per_slot
        pool = min(self.kv_cache_bytes, max(left, 0)) if self.kv_cache_bytes is not None else max(left, 0)
        per_block = self.kv_bytes_per_block(block_size)
        blocks = int(pool // per_block)
        return MemoryPlan(budget_per_device=budget, weights_per_device=self.weight_bytes_per_device,
                          reserve_per_device=reserve, kv_pool_per_device=blocks * per_block,
                          kv_bytes_per_token_device=self.kv_bytes_per_token_device, num_blocks=blocks,
                          block_size=block_size, num_devices=self.tp, kv_layout=self.model.kv_layout,
                          state_slots=slots, state_live_slots=live, state_bytes_per_slot=self.state_bytes_per_slot)


@dataclass(frozen=True)
class MemoryPlan:
    budget_per_device: float  # memory x gpu_memory_utilization
    weights_per_device: float
    reserve_per_device: float
    kv_pool_per_device: float
    kv_bytes_per_token_device: int
    num_blocks: int
    block_size: int
    num_devices: int
    kv_layout: KVGroups | None = None  # None: one group of every layer
    # a hybrid model's recurrent-state slots (``config.state_slots``): all, those running requests may hold (the
    # rest keep prefix snapshots), and one slot's bytes
    state_slots: int = 0
    state_live_slots: int = 0
    state_bytes_per_slot: int = 0

    @property
    def state_bytes_per_device(self) -> int:
        return self.state_slots * self.state_bytes_per_slot

    @property
    def kv_tokens(self) -> int:
        """Tokens the pool holds in every layer (a sliding-window model's sequences keep fewer: ``fits``)."""
        groups = 1 if self.kv_layout is None else len(self.kv_layout.windows)
        return self.num_blocks * self.block_size // groups

    def blocks_per_sequence(self, seq_len: int) -> int:
        """Blocks a sequence of ``seq_len`` tokens holds: per group, its tokens (a sliding group: its window's, and
        the block the window starts in)."""
        windows = (0,) if self.kv_layout is None else self.kv_layout.windows
        bs = self.block_size
        return sum(-(-seq_len // bs) if not w or w >= seq_len else min(-(-seq_len // bs), -(-w // bs) + 1)
                   for w in windows)

    def sequences_that_fit(self, seq_len: int) -> int:
        return self.num_blocks // self.blocks_per_sequence(seq_len)

    @property
    def fits(self) -> bool:
        return self.num_blocks > 0

    @property
    def total_bytes(self) -> float:
        """Weights + KV pool (+ state slots) over all devices."""
        return (self.weights_per_device + self.kv_pool_per_device + self.state_bytes_per_device) * self.num_devices


def _keys_attended(q: int, c0: int, window: int) -> float:
    """Sum over ``q`` query rows at positions c0 .. c0+q-1 of the keys each attends to: its prefix (causal), at
    most ``window`` (0: no window)."""
    full = q * c0 + q * (q + 1) / 2
    if not window or c0 + q <= window:
        return full
    capped = q - max(0, window - c0)  # rows whose prefix exceeds the window
    first = max(c0, window)  # those rows' positions start here (0-based); each would see position + 1 keys
    return full - sum_range(first + 1, c0 + q) + capped * window


def sum_range(a: int, b: int) -> float:
    """a + (a+1) + ... + b."""
    return (a + b) * (b - a + 1) / 2 if b >= a else 0.0


# ------------------------------------------------------------------ one step
@dataclass(frozen=True)
class SeqWork:
    """One sequence's part of a step: ``query_tokens`` computed after ``context_before`` cached/computed ones;
    ``sampled_rows`` of them go through the LM head (1 at the end of a prompt or for a decode, 1 + drafts when
    verifying speculative tokens, 0 for a prefill chunk that does not reach the end)."""

    query_tokens: int
    context_before: int
    sampled_rows: int


def work_from_scheduler_output(so) -> tuple[SeqWork, ...]:
    """The step's work as the scheduler decided it (``pagedllm.outputs.SchedulerOutput``)."""
    return tuple(SeqWork(len(s.token_ids), s.num_computed_tokens, (1 + s.num_spec_tokens) if s.sample else 0)
                 for s in so.scheduled)


@dataclass(frozen=True)
class OpTime:
    name: str
    flops: float
    bytes: float
    compute_s: float
    memory_s: float

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclass(frozen=True)
class StepCost:
    ops: tuple[OpTime, ...]
    allreduce_s: float
    overhead_s: float
    num_tokens: int
    num_seqs: int
    breakdown: dict = field(default_factory=dict, compare=False)

    @property
    def compute_s(self) -> float:
        return sum(o.time_s for o in self.ops)

    @property
    def time_s(self) -> float:
        return self.compute_s + self.allreduce_s + self.overhead_s

    def op(self, name: str) -> OpTime:
        for o in self.ops:
            if o.name == name:
                return o
        raise KeyError(name)


class CostModel:
    """Prices steps of one deployment. ``include_overheads=False`` leaves out the fixed per-step / per-sequence
    / per-token terms (what calibration fits)."""

    def __init__(self, deployment: Deployment, include_overheads: bool = True) -> None:
        self.dep = deployment
        self.include_overheads = include_overheads
        m, hw, tp = deployment.model, deployment.hardware, deployment.tp
        self._act = hw.activation_bytes
        self._bw = hw.attainable_bw
        # per kind of linear: (name, flops per row, bytes of one matrix per layer x layers, activation elements per
        # row, format, the group: how many of its matrices a step reads)
        self._linears = []
        for g in m.linear_groups():
            i, o = g.in_features, g.out_features
            sharded_in = i // tp if g.name in ("o", "mlp_down") else i
            sharded_out = o if g.name in ("o", "mlp_down") else o // tp
            self._linears.append((g.name, 2 * i * o * g.active / tp * g.layers,
                                  deployment.scheme.linear.matrix_bytes(i, o) / tp * g.layers,
                                  (sharded_in + sharded_out) * g.active * g.layers, deployment.scheme.linear, g))
        self._head_fmt = deployment.scheme.head_format(m)
        self._head_bytes = self._head_fmt.matrix_bytes(m.hidden_size, m.vocab_size) / tp
        self._embed_bpw = deployment.scheme.embed.bytes_per_weight
        self._kv_layer = deployment.kv_bytes_per_token_layer
        # per window (or 0): (window, layers, those keeping K/V of their own, this device's query heads x head size
        # summed over the layers)
        own = set(m.kv_layers())
        by_window: dict[int, list[tuple[int, bool]]] = {}
        for i, (window, hd) in enumerate(m.attention_layers()):
            by_window.setdefault(window, []).append((hd // tp, i in own))
        self._windows = [(w, len(v), sum(o for _, o in v), sum(hd for hd, _ in v)) for w, v in sorted(by_window.items())]
        self._attn_rate = hw.peak_flops(hw.attention_dtype) * hw.attention_efficiency
        # a hybrid model's state layers: the recurrences' FLOPs per token (at attention's rate: vector and small
        # matrix work, as the fused kernel's), and one sequence's states, read and written once per step
        self._state_flops = m.state_flops_per_token() if m.state_layers() else 0.0
        self._state_bytes = deployment.state_bytes_per_slot

    def _gemm(self, name: str, rows: int, flops: float, nbytes: float, fmt) -> OpTime:
        hw = self.dep.hardware
        rate = hw.peak_flops(fmt.compute_dtype) * hw.gemm_efficiency(rows) * fmt.compute_factor
        return OpTime(name, flops, nbytes, flops / rate, nbytes / self._bw)

    def _ring(self, nbytes: float) -> float:
        t = self.dep.tp
        if t == 1 or nbytes <= 0:
            return 0.0
        hw = self.dep.hardware
        link = hw.interconnect_bw * hw.interconnect_efficiency
        return 2 * (t - 1) / t * nbytes / link + 2 * (t - 1) * hw.interconnect_latency_s

    def step(self, work: Sequence[SeqWork]) -> StepCost:
        m, hw, tp = self.dep.model, self.dep.hardware, self.dep.tp
        rows = sum(w.query_tokens for w in work)
        sampled = sum(w.sampled_rows for w in work)
        ops = []
        if rows:
            for name, flops_row, wbytes, act_row, fmt, group in self._linears:
                ops.append(self._gemm(name, rows, flops_row * rows, wbytes * group.touched(rows)
                                      + act_row * rows * self._act, fmt))
            # attention: each query row attends to its own prefix (causal); K/V of the context read once per
            # sequence and layer, the new tokens' K/V written
            # (a sliding-window layer: at most its window of keys per query row)
            a_flops = a_bytes = 0.0
            for w in work:
                q, c0 = w.query_tokens, w.context_before
                for window, layers, own, hd in self._windows:
                    a_flops += 4 * hd * _keys_attended(q, c0, window)
                    read = c0 if not window else min(c0, window)
                    # every layer reads its (or its source's) cache rows; those with K/V of their own write theirs
                    a_bytes += self._kv_layer * (layers * read + own * 2 * q) + 2 * q * hd * self._act
            ops.append(OpTime("attention", a_flops, a_bytes, a_flops / self._attn_rate, a_bytes / self._bw))
            if self._state_bytes:  # every sequence's states read and written once (a prefill chunk's scan too)
                s_flops = self._state_flops * rows
                s_bytes = 2 * self._state_bytes * len(work)
                ops.append(OpTime("state", s_flops, s_bytes, s_flops / self._attn_rate, s_bytes / self._bw))
            e_bytes = rows * m.hidden_size * (self._embed_bpw / tp + self._act)
            ops.append(OpTime("embedding", 0.0, e_bytes, 0.0, e_bytes / self._bw))
        if sampled:
            v_dev = m.vocab_size / tp
            ops.append(self._gemm("lm_head", sampled, 2 * sampled * m.hidden_size * v_dev,
                                  self._head_bytes + sampled * (m.hidden_size * self._act + v_dev * 4), self._head_fmt))
        allreduce = 0.0
        if tp > 1 and rows:
            allreduce = 2 * m.num_layers * self._ring(rows * m.hidden_size * self._act)
            if sampled:  # all-gather of the vocab-parallel logits: half a ring all-reduce's traffic
                allreduce += self._ring(sampled * m.vocab_size * 4) / 2
        overhead = 0.0
        if self.include_overheads and work:
            overhead = hw.step_overhead_s + hw.seq_overhead_s * len(work) + hw.token_overhead_s * rows
        return StepCost(tuple(ops), allreduce, overhead, rows, len(work))

    def step_time(self, work: Sequence[SeqWork]) -> float:
        return self.step(work).time_s

    def decode_step(self, batch: int, context: int, spec_tokens: int = 0) -> StepCost:
        """A step of ``batch`` decodes, each after ``context`` tokens (plus ``spec_tokens`` drafts to verify)."""
        return self.step([SeqWork(1 + spec_tokens, context, 1 + spec_tokens)] * batch)

    def prefill_step(self, batch: int, prompt_len: int) -> StepCost:
        """A step of ``batch`` whole prompts of ``prompt_len`` tokens, each sampling its first token."""
        return self.step([SeqWork(prompt_len, 0, 1)] * batch)
