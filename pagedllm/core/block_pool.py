"""The pool of KV cache blocks: reference counts, an O(1) LRU free queue and the hash -> block map.

Pure Python, no torch. A block whose reference count drops to 0 goes to the tail of the free queue but keeps its
cached content (and hash) until it is popped from the head for reuse: least recently freed is evicted first.
"""

from __future__ import annotations

import hashlib
from array import array

from pagedllm.outputs import KVBlockRemoved, KVBlockStored

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: list[int] | tuple[int, ...]) -> BlockHash:
    """Chained hash of one full block: sha256(parent hash || token ids)."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to verify a hit token by token
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove (a cache hit on a free block)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock | None, block: KVCacheBlock) -> None:
        assert prev is not None
        nxt = prev.next_free
        assert nxt is not None
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block
        self.num_free += 1

    def __iter__(self):
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """``reserve_null``: block 0 is the null block, the place of a block a sliding-window group does not hold; it
    is never handed out, freed or written, and not counted in ``num_blocks``."""

    def __init__(self, num_blocks: int, enable_caching: bool, reserve_null: bool = False,
                 record_events: bool = False) -> None:
        if num_blocks < 1 + reserve_null:
            raise ValueError(f"num_blocks must be >= {1 + reserve_null}, got {num_blocks}")
        self.num_blocks = num_blocks - reserve_null  # the blocks requests can hold
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0] if reserve_null else None
        self.free_queue = FreeBlockQueue(self.blocks[reserve_null:])
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        # the cache's stored / removed blocks, in order, until take_events (None: not recorded)
        self.events: list | None = [] if record_events and enable_caching else None

    def take_events(self) -> list:
        """The prefix cache's changes since the last call, in order (empty unless ``events`` is a list)."""
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    def _removed(self, block_hash: BlockHash) -> None:
        if self.events is not None:
            self.events.append(KVBlockRemoved(block_hash))

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, including cached ones that would be evicted)."""
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of the pool held by requests."""
        return 1.0 - self.free_queue.num_free / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget a block's cached content (it stays allocated)."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            self._removed(block.block_hash)
        block.block_hash = None
        block.token_ids = None

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self._removed(block.block_hash)
            block.block_hash = None
            block.token_ids = None
            self.num_evictions += 1

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order) -> None:
        """Blocks whose last reference goes: cached ones join the tail of the LRU queue (evicted last); blocks
        without cached content go to its head and are handed out again first, so the cache keeps reusing memory
        that is already committed and warm (a never-used block costs a page fault per 4 KiB on first write,
        docs/history.md#figures-from-code-comments) instead of cycling through the whole budget."""
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: tuple[int, ...],
                    parent_hash: BlockHash | None = None) -> None:
        if block.block_hash is not None:
            return  # already registered (a hit, or cached before)
        if block_hash in self.cached:
            return  # another block holds this content already; this one stays uncached
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.append(KVBlockStored(block_hash, parent_hash, token_ids))

    def check_integrity(self) -> None:
        """free + in use == total; free blocks have no references; the hash map points at its blocks."""
        free = list(self.free_queue)
        assert len(free) == self.free_queue.num_free, "free count out of sync"
        assert len({b.block_id for b in free}) == len(free), "a block is in the free queue twice"
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        assert self.null_block is None or (self.null_block.ref_cnt == 0 and self.null_block.block_hash is None
                                           and self.null_block.prev_free is None), "the null block was used"
        assert all(b.ref_cnt == 0 for b in free), "a referenced block is in the free queue"
        assert len(free) + len(in_use) == self.num_blocks, (
            f"leak: free={len(free)} in_use={len(in_use)} total={self.num_blocks}"
        )
        for h, b in self.cached.items():
            assert b.block_hash == h, "hash map out of sync"


class HostBlockPool:
    """Ids of host-side blocks that hold swapped-out KV (the worker owns the memory)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"cannot take {n} host blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, ids: list[int]) -> None:
        self._free.extend(ids)
        assert len(self._free) <= self.num_blocks and len(set(self._free)) == len(self._free), "host block double free"
