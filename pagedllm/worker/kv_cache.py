"""The paged KV cache of one rank: how many blocks fit the memory budget, the per-layer K/V block tensors (the
target model's, and a draft model's in the same blocks), the host blocks that swapped-out KV waits in, and the
block copies between them."""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

from pagedllm.config import CacheConfig

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, count: int = 1) -> list[torch.Tensor]:
    """``count`` zero-filled KV tensors of ``shape``. On CPU they are views of one anonymous mapping, so pages are
    committed only when first written: the process's resident memory grows with the KV cache actually used, not
    with the budget. One buffer, not one per tensor: glibc serves a freed-then-requested block below its mmap
    threshold from the heap and must clear it, so a per-tensor cache made every engine start after the first in a
    process zero the whole cache (the measured cost: docs/history.md). In 4 KiB pages (``MADV_NOHUGEPAGE``; numpy's
    ``zeros`` asks for transparent huge pages): under a hypervisor a huge page's first touch can cost milliseconds,
    and a step writing the first tokens of its blocks touches a new one every 2 MiB of each layer's cache, which
    slowed a fresh server's first runs (docs/history.md#figures-from-code-comments)."""
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    nbytes = math.prod(shape) * dtype.itemsize
    if hasattr(mmap, "MAP_ANONYMOUS") and hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        buf = mmap.mmap(-1, max(1, nbytes * count), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_NOHUGEPAGE)
        flat = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the mapping alive
    else:
        flat = torch.from_numpy(np.zeros(nbytes * count, dtype=np.uint8))
    return [flat[i * nbytes:(i + 1) * nbytes].view(dtype).view(shape) for i in range(count)]


class KVCache:
    """Blocks for ``model`` and ``draft_model`` (if any; each with ``cfg.num_layers``, ``cfg.head_dim`` and this
    rank's ``num_kv_heads``). Nothing is allocated until ``allocate``.

    The model's layers form KV groups (``cfg.kv_groups()``): a block holds ``slots`` layers, and layer i reads and
    writes cache tensor ``slot[i]`` at its group's blocks; ``kv_caches`` has one (K, V) pair per layer, the layers
    of one slot sharing their tensors. Without sliding-window layers: one group, a tensor pair per layer."""

    def __init__(self, config: CacheConfig, model, draft_model, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.model = model
        self.draft_model = draft_model
        models = [model] + ([draft_model] if draft_model is not None else [])
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.groups = model.cfg.kv_groups()
        if self.groups.hybrid and draft_model is not None:
            raise ValueError("a draft model with a sliding-window target model is not supported yet "
                             "(use ngram speculation)")
        # the state layers' pools (Gated DeltaNet: conv inputs and state matrix; a short convolution: its inputs):
        # per layer, each pool's (shape per slot, float32?)
        self.state_layers = model.cfg.state_layers() if hasattr(model.cfg, "state_layers") else []
        self.state_shapes = [model.layers[i].attn.state_shapes() for i in self.state_layers]
        # the pools not in float32 are in the activations' dtype (not the KV cache's)
        self.state_dtype = getattr(model, "dtype", dtype)
        self.state_bytes_per_slot = sum(math.prod(shape) * (4 if f32 else self.state_dtype.itemsize)
                                        for pools in self.state_shapes for shape, f32 in pools)
        self.num_state_slots = 0
        self.state_caches: list[tuple[torch.Tensor, ...]] = []  # per state layer: its pools, a row per slot
        self.num_host_state_slots = 0  # with swap preemption: host rows a swapped-out sequence's states wait in
        self.host_state_caches: list[tuple[torch.Tensor, ...]] = []
        elem = dtype.itemsize
        # KV bytes of one block across its layers (the draft model's layers included)
        self.bytes_per_block = sum(2 * self._slots(m) * self.block_size * self._width(m) * elem for m in models)
        self.num_blocks = 0
        self.kv_caches: KVLayers = []  # the target model's layers
        self.slot_caches: KVLayers = []  # its distinct (K, V) tensors, one pair per slot (what swaps copy)
        self.draft_kv_caches: KVLayers = []
        self.num_host_blocks = 0
        self.host_kv_caches: KVLayers = []

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def budget_blocks(self, state_bytes: int = 0) -> int:
        """The blocks the memory budget holds (``--kv-cache-memory``, the GPU's free memory, or the CPU default).
        ``state_bytes``: a hybrid model's state pools, taken from the GPU's free memory first (on CPU they sit
        beside the budget, committed only as sequences touch them)."""
        c = self.config
        if c.num_gpu_blocks_override is not None:
            return c.num_gpu_blocks_override
        if c.kv_cache_memory is not None:
            budget = c.kv_cache_memory
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            activation_reserve = 1 << 30
            budget = int(total * c.gpu_memory_utilization) - (total - free) - activation_reserve - state_bytes
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        return max(budget // self.bytes_per_block, 0)

    @property
    def state_bytes(self) -> int:
        """The recurrent state pools' bytes (0 without linear layers)."""
        return self.num_state_slots * self.state_bytes_per_slot

    def allocate(self, num_blocks: int, max_model_len: int, num_state_slots: int = 0) -> None:
        """The device blocks of every model, ``num_state_slots`` recurrent states per linear layer (a model with
        such layers), and with ``preemption_mode='swap'`` the host blocks; a ValueError when one request of
        ``max_model_len`` tokens would not fit."""
        c = self.config
        self.num_blocks = num_blocks
        if self.state_layers:
            self.num_state_slots = num_state_slots
            dt, dev = self.state_dtype, self.device
            # lazily committed like the KV blocks: a slot's pages are resident once a sequence uses it
            self.state_caches = [tuple(zeros((num_state_slots, *shape), torch.float32 if f32 else dt, dev)[0]
                                       for shape, f32 in pools) for pools in self.state_shapes]
        per_seq = math.ceil(max_model_len / self.block_size)
        # a sliding group holds at least its window's blocks (and one reserved null block)
        needed = sum(min(per_seq, math.ceil(w / self.block_size) + 1) if w else per_seq
                     for w in self.groups.windows) + self.groups.hybrid
        if needed > num_blocks:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens "
                f"({num_blocks * self.block_size} tokens) but max_model_len={max_model_len} needs "
                f"{needed} blocks for a single request ({len(self.groups.windows)} layer groups): raise "
                f"--kv-cache-memory / --gpu-memory-utilization "
                f"or lower --max-model-len"
            )
        shape = self._shape(self.model)
        self.slot_caches = self._slot_pairs(self.model)
        states = iter(self.state_caches)
        self.kv_caches = [self._layer_view(self.slot_caches[j], i) if j >= 0 else next(states)
                          for i, j in enumerate(self.groups.slot)]
        if c.preemption_mode == "swap":
            if self.draft_model is not None:
                raise ValueError("preemption_mode='swap' together with a draft model is not supported yet")
            self.num_host_blocks = c.num_host_blocks_override or int(c.swap_space * 2**30 // self.bytes_per_block)
            if self.num_host_blocks < 1:
                raise ValueError(f"swap_space {c.swap_space} GiB holds no KV block "
                                 f"({self.bytes_per_block} bytes each)")
            pin = self.device.type == "cuda"
            self.host_kv_caches = [
                tuple(torch.zeros((self.num_host_blocks, *shape[1:]), dtype=self.dtype, pin_memory=pin)
                      for _ in range(2))
                for _ in range(self.groups.slots)
            ]
            if self.state_layers:  # a swapped-out sequence's states too: up to one per live slot, within the space
                self.num_host_state_slots = min(num_state_slots, int(c.swap_space * 2**30 // self.state_bytes_per_slot))
                if self.num_host_state_slots < 1:
                    raise ValueError(f"swap_space {c.swap_space} GiB holds no recurrent state "
                                     f"({self.state_bytes_per_slot} bytes each)")
                self.host_state_caches = [  # committed as swap-outs write them
                    tuple(zeros((self.num_host_state_slots, *shape), torch.float32 if f32 else self.state_dtype,
                                torch.device("cpu"))[0] for shape, f32 in pools) for pools in self.state_shapes]
        if self.draft_model is not None:
            self.draft_kv_caches = self._slot_pairs(self.draft_model)

    def _shape(self, model) -> tuple[int, int, int]:
        """A cache tensor: (blocks, block_size, values per token), each layer viewing it with its heads
        (``_layer_view``)."""
        return (self.num_blocks, self.block_size, self._width(model))

    def _width(self, model) -> int:
        """K (or V) values per token of a cache tensor: the widest layer's (Gemma 4's full layers are wider than
        its sliding ones, which share the tensors and use each token's first values)."""
        cfg = model.cfg
        return cfg.kv_width(model.num_kv_heads if model.num_kv_heads != cfg.num_kv_heads else None)

    def _layer_view(self, pair: tuple[torch.Tensor, torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s (blocks, block_size, heads, head_dim) views of a slot's tensors."""
        cfg = self.model.cfg
        heads = self.model.num_kv_heads if self.model.num_kv_heads != cfg.num_kv_heads else cfg.layer_kv_heads(layer)
        d = cfg.layer_head_dim(layer)
        return tuple(t[..., : heads * d].unflatten(-1, (heads, d)) for t in pair)

    def _slots(self, model) -> int:
        return self.groups.slots if model is self.model else model.cfg.num_layers

    def _slot_pairs(self, model) -> KVLayers:
        """One (K, V) tensor pair per slot (the draft model: per layer)."""
        n = self._slots(model)
        t = zeros(self._shape(model), self.dtype, self.device, 2 * n)
        if model is self.model:
            return [(t[2 * j], t[2 * j + 1]) for j in range(n)]
        shape = (model.num_kv_heads, model.cfg.head_dim)
        return [(t[2 * j].unflatten(-1, shape), t[2 * j + 1].unflatten(-1, shape)) for j in range(n)]

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
             state_out: list[tuple[int, int]] = (), state_in: list[tuple[int, int]] = ()) -> None:
        """Copy whole KV blocks device -> host (swap-outs first: their device blocks may be reused this step),
        then host -> device; a hybrid model's recurrent states likewise, by slot (before the step zeroes or
        restores any slot)."""
        for pairs, src_pools, dst_pools in ((state_out, self.state_caches, self.host_state_caches),
                                            (state_in, self.host_state_caches, self.state_caches)):
            if pairs:
                src = torch.tensor([p[0] for p in pairs], device=src_pools[0][0].device)
                dst = torch.tensor([p[1] for p in pairs], device=dst_pools[0][0].device)
                for s, d in zip((t for pools in src_pools for t in pools), (t for pools in dst_pools for t in pools)):
                    d.index_copy_(0, dst, s.index_select(0, src).to(d.device))
        if swap_out:
            dev = torch.tensor([d for d, _ in swap_out], device=self.device)
            host = torch.tensor([h for _, h in swap_out])
            for (kc, vc), (hk, hv) in zip(self.slot_caches, self.host_kv_caches):
                hk.index_copy_(0, host, kc.index_select(0, dev).to("cpu"))
                hv.index_copy_(0, host, vc.index_select(0, dev).to("cpu"))
        if swap_in:
            host = torch.tensor([h for h, _ in swap_in])
            dev = torch.tensor([d for _, d in swap_in], device=self.device)
            for (kc, vc), (hk, hv) in zip(self.slot_caches, self.host_kv_caches):
                kc.index_copy_(0, dev, hk.index_select(0, host).to(self.device))
                vc.index_copy_(0, dev, hv.index_select(0, host).to(self.device))

    def reset_states(self, slots: list[int]) -> None:
        """Zero these slots' recurrent states (a sequence starting from its first token)."""
        if slots:
            idx = torch.tensor(slots, device=self.device)
            for pool in (t for pools in self.state_caches for t in pools):
                pool.index_fill_(0, idx, 0)

    def state_rows(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """A copy of these slots' states, pool by pool (what ``put_state_rows`` writes back)."""
        return [pool.index_select(0, slots) for pools in self.state_caches for pool in pools]

    def put_state_rows(self, saved: list[torch.Tensor], idx: torch.Tensor, slots: torch.Tensor) -> None:
        """Write rows ``idx`` of a ``state_rows`` copy back into ``slots``."""
        for pool, rows in zip((t for pools in self.state_caches for t in pools), saved):
            pool.index_copy_(0, slots, rows.index_select(0, idx))

    def copy_states(self, pairs: list[list[int]]) -> None:
        """Copy slot src's states to slot dst, for each [src, dst] (a prefix-cache snapshot restored)."""
        if pairs:
            src = torch.tensor([p[0] for p in pairs], device=self.device)
            dst = torch.tensor([p[1] for p in pairs], device=self.device)
            for pool in (t for pools in self.state_caches for t in pools):
                pool.index_copy_(0, dst, pool.index_select(0, src))
