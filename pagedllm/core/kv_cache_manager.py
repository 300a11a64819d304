"""Per-request block tables on top of the block pool, with prefix caching. Pure Python, no torch."""

from __future__ import annotations

from pagedllm.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many leading blocks of a request are registered
        # Prefix cache statistics, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        toks = request.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, toks[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request; at least one token is left to compute."""
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self._block_hashes(request, max_blocks)
        hits: list[KVCacheBlock] = []
        toks = request.all_token_ids
        for i in range(max_blocks):
            block = self.pool.get_cached_block(hashes[i], tuple(toks[i * bs : (i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

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
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` (+ speculative lookahead) after the computed ones.

        ``new_computed_blocks`` are prefix-cache hits the request takes now. Returns the newly allocated blocks,
        or None (and changes nothing) when the pool cannot supply them.
        """
        new_computed_blocks = new_computed_blocks or []
        bs = self.block_size
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, bs)
        num_new_blocks = num_required - len(req_blocks) - len(new_computed_blocks)
        # Hits sitting in the free queue stop being free once taken.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(req_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            # Register the full blocks that hold tokens computed by the end of this step (never speculative
            # ones). Content is written layer by layer before any attention reads it, so a request that hits
            # one of these blocks in the same step reads what this one writes.
            self._cache_full_blocks(request, (num_computed + num_new_tokens) // bs)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        rid = request.request_id
        start = self.num_cached_blocks.get(rid, 0)
        if num_full_blocks <= start:
            return
        hashes = self._block_hashes(request, num_full_blocks)
        blocks = self.req_to_blocks[rid]
        bs = self.block_size
        toks = request.all_token_ids
        for i in range(start, num_full_blocks):
            self.pool.cache_block(blocks[i], hashes[i], tuple(toks[i * bs : (i + 1) * bs]))
        self.num_cached_blocks[rid] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release a request's blocks; tail blocks first, so they are evicted before shared prefix blocks."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self.pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(rid, None)

    def uncache_private_blocks(self, request: Request) -> None:
        """A request failed mid-step: blocks only it holds may have been registered before their content was
        written, so take them out of the prefix cache."""
        for block in self.req_to_blocks.get(request.request_id, ()):
            if block.ref_cnt == 1:
                self.pool.uncache(block)

    def forget(self, request: Request) -> None:
        """Drop the cached hashes of a finished request (its token list may not change any more)."""
        self.req_to_hashes.pop(request.request_id, None)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held = sum(len(v) for v in self.req_to_blocks.values())
        refs = sum(b.ref_cnt for b in self.pool.blocks)
        assert held == refs, f"block references ({refs}) != blocks held by requests ({held})"
