"""Per-request block tables on top of the block pool, with prefix caching. Pure Python, no torch."""

from __future__ import annotations

from pagedllm.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.core.state_pool import StatePool
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables per request and per layer group (``windows``: one entry per group, 0 for full attention or
    a sliding window in tokens; see ``model.arch.KVGroups``), all drawn from one pool of equal blocks.

    A sliding group's table keeps only the blocks inside its window: before each allocation, the blocks wholly
    before the window of the first token computed next are freed (they stay in the prefix cache until evicted) and
    their places point at the null block, a reserved block nothing writes. Prefix caching keys each group's blocks
    apart; a hit needs every block of the full groups and, of the sliding groups, those inside the window of the
    first token left to compute."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 windows: tuple[int, ...] = (0,), record_events: bool = False, num_state_slots: int = 0,
                 state_live_slots: int | None = None, shifted_kv: bool = False) -> None:
        """``num_state_slots`` > 0: the model has linear-attention layers; each running request also holds a
        recurrent-state slot (``StatePool``), and a prefix-cache hit needs the state snapshot saved after the
        prefix's last block (each prompt saves one at its last block boundary, into a slot beyond the
        ``state_live_slots`` that running requests may claim).

        ``shifted_kv``: some layers' K/V at a position depend on the token after it (an MTP module's: it reads the
        next token's embedding), so a block's last position depends on the next block's first token, which its
        hash does not cover: a hit stops one block short of the longest cached prefix and that block is computed
        again (a hybrid saves its prompt's snapshot one block earlier to match), as vLLM does for EAGLE."""
        self.block_size = block_size
        self.shifted_kv = shifted_kv
        self.enable_caching = enable_caching
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        # the null block: the place of a block a sliding group has freed (or never needed)
        # record_events: the prefix cache's stored / removed blocks are kept for the pool's take_events
        self.pool = BlockPool(num_blocks, enable_caching, reserve_null=any(self.windows), record_events=record_events)
        self.null_block = self.pool.null_block
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}  # per request, per group
        self.req_to_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many leading blocks of a request are registered
        self._window_start: dict[str, int] = {}  # per request: blocks before this are freed in the sliding groups
        self.states = StatePool(num_state_slots, state_live_slots) if num_state_slots else None
        self._restore: dict[str, int] = {}  # request -> the snapshot slot its prefix hit restores (this step)
        self._saves: dict[str, tuple[int, int]] = {}  # request -> (rows into this step's chunk, snapshot slot)
        self._pending: dict[str, tuple[bytes, int]] = {}  # snapshots being written: request -> (key, slot)
        # Prefix cache statistics, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, req_id: str) -> list[list[int]]:
        """The request's block table of each group."""
        tables = self.req_to_blocks.get(req_id)
        if tables is None:
            return [[] for _ in self.windows]
        return [[b.block_id for b in t] for t in tables]

    def num_held_blocks(self, req_id: str) -> int:
        """Blocks the request holds (the null block not counted)."""
        return sum(1 for t in self.req_to_blocks.get(req_id, ()) for b in t if b is not self.null_block)

    def first_needed_block(self, group: int, num_computed: int) -> int:
        """The group's first block that the next token computed (at position ``num_computed``) may read."""
        w = self.windows[group]
        return max(0, num_computed - w + 1) // self.block_size if w else 0

    def computed_block_ids(self, req_id: str, num_computed: int) -> list[int]:
        """The blocks that hold the request's first ``num_computed`` tokens and that the next token may read, group
        after group (what a swap-out copies, and a swap-in fills after allocating the same way)."""
        n = cdiv(num_computed, self.block_size)
        tables = self.req_to_blocks.get(req_id, [[] for _ in self.windows])
        return [b.block_id for g, t in enumerate(tables) for b in t[self.first_needed_block(g, num_computed):n]]

    def blocks_needed(self, num_tokens: int) -> int:
        """At most how many blocks a request of ``num_tokens`` tokens holds, computed in one step."""
        return self.num_groups * cdiv(num_tokens, self.block_size)

    def _key(self, group: int, block_hash: BlockHash) -> BlockHash:
        return block_hash if self.num_groups == 1 else group.to_bytes(2, "little") + block_hash

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        toks = request.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, toks[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """The longest cached prefix of the request, in whole blocks (per group; at least one token is left to
        compute): every full group's blocks from the start, and the sliding groups' blocks inside the window of
        the first token left to compute (before it, the null block)."""
        empty = [[] for _ in self.windows]
        if not self.enable_caching:
            return empty, 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self._block_hashes(request, max_blocks)
        toks = request.all_token_ids

        def lookup(g: int, i: int) -> KVCacheBlock | None:
            return self.pool.get_cached_block(self._key(g, hashes[i]), tuple(toks[i * bs : (i + 1) * bs]))

        full = [g for g, w in enumerate(self.windows) if not w]
        n = 0  # leading blocks every full group has cached
        while n < max_blocks and all(lookup(g, n) is not None for g in full):
            n += 1
        if self.shifted_kv and n:
            n -= 1
        sliding = [g for g, w in enumerate(self.windows) if w]
        while n and sliding:  # the longest prefix whose window every sliding group has cached
            if all(lookup(g, i) is not None for g in sliding for i in range(self.first_needed_block(g, n * bs), n)):
                break
            n -= 1
        if self.states is not None:  # the linear layers' state after the prefix: only where a snapshot was kept
            while n and self.states.snapshot(self._key(0, hashes[n - 1])) is None:
                n -= 1
            if n:
                slot = self.states.snapshot(self._key(0, hashes[n - 1]))
                self.states.touch(slot)
                self._restore[request.request_id] = slot
        hits = [[lookup(g, i) if i >= self.first_needed_block(g, n * bs) else self.null_block for i in range(n)]
                for g in range(self.num_groups)]
        return hits, n * bs

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup (failed admissions that are retried are not counted twice)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    # ------------------------------------------------------------------ changes
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVCacheBlock]] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` (+ speculative lookahead) after the computed ones.

        ``new_computed_blocks`` are prefix-cache hits the request takes now (per group, as ``get_computed_blocks``
        gives them). First the sliding groups free the blocks that fell out of their windows. Returns the newly
        allocated blocks, or None (and changes nothing more) when the pool cannot supply them.
        """
        rid = request.request_id
        bs = self.block_size
        hits = new_computed_blocks or [[] for _ in self.windows]
        num_hits = len(hits[0])
        states = self.states
        if states is not None and rid not in states.owner and states.num_free == 0:
            return None  # no recurrent-state slot for a new sequence
        tables = self.req_to_blocks.setdefault(rid, [[] for _ in self.windows])
        num_computed = request.num_computed_tokens + num_hits * bs
        self._free_outside_windows(rid, tables, num_computed)
        have = len(tables[0]) + num_hits
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, bs)
        # per group: how many new places are left null (before the window)
        nulls = [max(0, min(self.first_needed_block(g, num_computed), num_required) - have)
                 for g in range(self.num_groups)]
        num_new_blocks = sum(max(0, num_required - have - k) for k in nulls)
        # Hits sitting in the free queue stop being free once taken.
        num_evictable_hits = sum(1 for t in hits for b in t if b.ref_cnt == 0 and b is not self.null_block)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            if not any(tables):
                del self.req_to_blocks[rid]
            return None
        if num_hits:
            self.pool.touch([b for t in hits for b in t if b is not self.null_block])
            for t, h in zip(tables, hits):
                t.extend(h)
            self.num_cached_blocks[rid] = len(tables[0])
        new_blocks = []
        for t, k in zip(tables, nulls):
            t.extend([self.null_block] * k)
            blocks = self.pool.get_new_blocks(max(0, num_required - len(t)))
            t.extend(blocks)
            new_blocks += blocks
        if self.enable_caching:
            # Register the full blocks that hold tokens computed by the end of this step (never speculative
            # ones). Content is written layer by layer before any attention reads it, so a request that hits
            # one of these blocks in the same step reads what this one writes.
            self._cache_full_blocks(request, (num_computed + num_new_tokens) // bs)
        if states is not None:
            restore = self._restore.pop(rid, None)
            slot = states.assign(rid)
            if num_hits and restore is not None and restore != slot:
                self._restore[rid] = restore  # read by take_state_ops for this step
            self._plan_snapshot(request, num_computed, num_new_tokens)
        return new_blocks

    def _plan_snapshot(self, request: Request, num_computed: int, num_new: int) -> None:
        """A prompt's chunk that reaches its last block boundary saves the state there (once per prefix)."""
        if not self.enable_caching or num_new < 2 or request.request_id in self._pending:  # (a 1-row chunk: decode)
            return
        b = ((request.num_prompt_tokens - 1) // self.block_size - self.shifted_kv) * self.block_size
        if not num_computed < b <= num_computed + num_new:
            return
        key = self._key(0, self._block_hashes(request, b // self.block_size)[b // self.block_size - 1])
        if self.states.snapshot(key) is not None or any(k == key for k, _ in self._pending.values()):
            return
        slot = self.states.reserve()
        if slot is not None:
            self._pending[request.request_id] = (key, slot)
            self._saves[request.request_id] = (b - num_computed, slot)

    def take_state_ops(self, req_id: str) -> tuple[int, int, int, int]:
        """The request's recurrent-state work this step: (its slot, the snapshot slot to restore first or -1,
        rows of its chunk after which to save a snapshot or 0, that snapshot's slot or -1)."""
        if self.states is None:
            return -1, -1, 0, -1
        rows, save = self._saves.pop(req_id, (0, -1))
        return self.states.owner.get(req_id, -1), self._restore.pop(req_id, -1), rows, save

    def discard_pending_snapshots(self) -> None:
        """The step that was to write them failed: their slots hold nothing reliable."""
        for _, slot in self._pending.values():
            self.states.discard(slot)
        self._pending.clear()
        self._saves.clear()

    def commit_snapshots(self) -> None:
        """The snapshots the last step wrote become hits (called once that step's results are in)."""
        for key, slot in self._pending.values():
            self.states.register(key, slot)
        self._pending.clear()

    def _free_outside_windows(self, rid: str, tables: list[list[KVCacheBlock]], num_computed: int) -> None:
        """Free the sliding groups' blocks that the token computed next (at ``num_computed``) can no longer read."""
        if self.null_block is None:
            return
        start = self._window_start.get(rid, 0)
        for g, t in enumerate(tables):
            end = min(self.first_needed_block(g, num_computed), len(t))
            if end <= start:
                continue
            gone = [b for b in t[start:end] if b is not self.null_block]
            t[start:end] = [self.null_block] * (end - start)
            self.pool.free_blocks(gone)
        self._window_start[rid] = max(start, min(self.first_needed_block(g, num_computed)
                                                 for g, w in enumerate(self.windows) if w))

    def _cache_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        rid = request.request_id
        start = self.num_cached_blocks.get(rid, 0)
        if num_full_blocks <= start:
            return
        hashes = self._block_hashes(request, num_full_blocks)
        tables = self.req_to_blocks[rid]
        bs = self.block_size
        toks = request.all_token_ids
        for i in range(start, num_full_blocks):
            for g, t in enumerate(tables):
                if t[i] is not self.null_block:
                    self.pool.cache_block(t[i], self._key(g, hashes[i]), tuple(toks[i * bs : (i + 1) * bs]),
                                          self._key(g, hashes[i - 1]) if i else None)
        self.num_cached_blocks[rid] = num_full_blocks

    def _held(self, rid: str) -> list[list[KVCacheBlock]]:
        return [[b for b in t if b is not self.null_block] for t in self.req_to_blocks.get(rid, ())]

    def free(self, request: Request) -> None:
        """Release a request's blocks; tail blocks first, so they are evicted before shared prefix blocks."""
        rid = request.request_id
        for t in self._held(rid):
            self.pool.free_blocks(reversed(t))
        self.req_to_blocks.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        self._window_start.pop(rid, None)
        if self.states is not None:
            self.states.release(rid)
            self._restore.pop(rid, None)

    def uncache_private_blocks(self, request: Request) -> None:
        """A request failed mid-step: blocks only it holds may have been registered before their content was
        written, so take them out of the prefix cache."""
        for t in self._held(request.request_id):
            for block in t:
                if block.ref_cnt == 1:
                    self.pool.uncache(block)
        pending = self._pending.pop(request.request_id, None)
        if pending is not None:  # its snapshot may be half written
            self.states.discard(pending[1])

    def forget(self, request: Request) -> None:
        """Drop the cached hashes of a finished request (its token list may not change any more)."""
        self.req_to_hashes.pop(request.request_id, None)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        if self.states is not None:
            self.states.check_integrity()
        held = sum(len(t) for rid in self.req_to_blocks for t in self._held(rid))
        refs = sum(b.ref_cnt for b in self.pool.blocks)
        assert held == refs, f"block references ({refs}) != blocks held by requests ({held})"
        for tables in self.req_to_blocks.values():
            assert len({len(t) for t in tables}) == 1, "the groups' block tables differ in length"
