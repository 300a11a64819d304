"""Recurrent-state slots of a hybrid model (linear-attention layers beside the paged KV). Pure Python, no torch.

Each running request holds one slot: the row of every linear layer's state pools that its sequence reads and
updates (``worker.kv_cache``). A free slot may hold a snapshot: the state after a prefix of whole blocks, keyed by
the hash of that prefix's last block (the chain hash the KV blocks are cached under), so that a later request with
that prefix restores it instead of recomputing the prefix (as vLLM's hybrid allocator and SGLang's mamba radix
cache keep states at block boundaries). A new sequence takes an empty free slot first, else the least recently used
snapshot's; a snapshot is registered only once the step that writes it has run."""

from __future__ import annotations

from collections import OrderedDict


class StatePool:
    def __init__(self, num_slots: int, live_slots: int | None = None) -> None:
        """``live_slots``: at most this many requests run at once (``--max-num-seqs``); a snapshot is written only
        into a slot beyond what they may still claim (default: none beyond ``num_slots``)."""
        self.num_slots = num_slots
        self.live_slots = num_slots if live_slots is None else min(live_slots, num_slots)
        self._free: OrderedDict[int, bytes | None] = OrderedDict((s, None) for s in range(num_slots))  # LRU first
        self._by_hash: dict[bytes, int] = {}
        self.owner: dict[str, int] = {}  # request id -> its live slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_snapshots(self) -> int:
        return len(self._by_hash)

    def take(self) -> int | None:
        """A free slot: an empty one if any (the most recently released: its pages are resident already, so the
        pools' resident memory follows the peak of concurrent sequences rather than every slot in turn), else the
        least recently used snapshot's (dropped); None: none free."""
        if not self._free:
            return None
        slot = next((s for s, k in reversed(self._free.items()) if k is None), None)
        if slot is None:
            slot, key = self._free.popitem(last=False)
            del self._by_hash[key]
        else:
            del self._free[slot]
        return slot

    def assign(self, req_id: str) -> int | None:
        """The request's live slot: the one it holds, or a new one (None: none is free)."""
        slot = self.owner.get(req_id)
        if slot is None:
            slot = self.take()
            if slot is not None:
                self.owner[req_id] = slot
        return slot

    def release(self, req_id: str) -> None:
        slot = self.owner.pop(req_id, None)
        if slot is not None:
            self._free[slot] = None

    def snapshot(self, key: bytes) -> int | None:
        """The free slot holding the state after the prefix ``key`` (None: no snapshot of it)."""
        return self._by_hash.get(key)

    def touch(self, slot: int) -> None:
        """A prefix hit used this snapshot: it is evicted last."""
        self._free.move_to_end(slot)

    def reserve(self) -> int | None:
        """A free slot for a snapshot the next step writes (``register`` after it ran, or ``discard``), or None
        when taking it could leave a request that may still start without a slot."""
        if self.num_free - 1 < self.live_slots - len(self.owner):
            return None
        return self.take()

    def register(self, key: bytes, slot: int) -> None:
        """The step that wrote the snapshot in ``slot`` ran: keep it (a newer one of the same prefix replaces)."""
        old = self._by_hash.pop(key, None)
        if old is not None:
            self._free[old] = None
        self._by_hash[key] = slot
        self._free[slot] = key

    def discard(self, slot: int) -> None:
        self._free[slot] = None

    def check_integrity(self) -> None:
        held = set(self.owner.values())
        assert len(held) == len(self.owner), "two requests hold one state slot"
        assert not held & set(self._free), "a held state slot is also free"
        assert all(self._free.get(s) == k for k, s in self._by_hash.items()), "a snapshot's slot is not free"
