"""Choosing one of N replicas for a request: round robin, or cache-aware.

Cache-aware: each replica remembers the chained hashes of the request starts it was sent (an LRU); a request goes,
among the replicas with at most ``slack`` more requests in flight than the least busy one, to the one that was sent
the longest start of it (a start worth following: half the request, or ``min_match`` chunks), else to the least
busy. The slack bounds what affinity may cost in queueing: a replica's prefix cache saves prefill, a longer queue
costs every request on it. One implementation for `serve --data-parallel-size`'s balancer (its chain: 32-character
chunks of the request's text) and the simulator (its chain: 8-token chunks of the prompt).
"""

from __future__ import annotations

from collections import OrderedDict

POLICIES = ("cache_aware", "round_robin")
# 8: measured on two 1-core replicas (SmolLM2, 8 system prompts, docs/benchmarks.md#replicas): a slack of 2 kept too
# little affinity (hit rate as round robin's, mean TTFT worse), 8 found nearly every prefix cached
DEFAULT_SLACK = 8
# a shared start of this many chunks is followed even when it is under half the request (more than a shared
# opening such as JSON keys or a role name: 1024 characters, about 256 tokens)
DEFAULT_MIN_MATCH = 32


class ReplicaRouter:
    def __init__(self, n: int, policy: str = "cache_aware", slack: int = DEFAULT_SLACK,
                 min_match: int = DEFAULT_MIN_MATCH, capacity: int = 1 << 16) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {list(POLICIES)}, got {policy!r}")
        self.policy, self.slack, self.min_match, self.capacity = policy, slack, min_match, capacity
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n)]
        self._turn = 0

    def matched(self, replica: int, chain: list[int]) -> int:
        """How many leading links of ``chain`` ``replica`` was sent."""
        seen, n = self.seen[replica], 0
        for h in chain:
            if h not in seen:
                break
            n += 1
        return n

    def record(self, replica: int, chain: list[int]) -> None:
        seen = self.seen[replica]
        for h in chain:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def forget(self, replica: int) -> None:
        """``replica`` lost its cache (it was restarted): nothing was sent to it."""
        self.seen[replica].clear()

    def choose(self, chain: list[int] | None, loads: dict[int, int]) -> int:
        """A replica among ``loads``' keys (the available ones, with their requests in flight) for a request whose
        start hashes to ``chain`` (None: nothing to match, e.g. a GET)."""
        if self.policy == "round_robin":
            ids = sorted(loads)
            self._turn += 1
            return ids[(self._turn - 1) % len(ids)]
        least = min(loads, key=lambda i: (loads[i], len(self.seen[i])))
        if not chain:
            return least
        need = max(1, min((len(chain) + 1) // 2, self.min_match))
        best, best_len = least, 0
        for i in loads:
            if loads[i] > loads[least] + self.slack:
                continue
            m = self.matched(i, chain)
            if m >= need and (m > best_len or (m == best_len and loads[i] < loads[best])):
                best, best_len = i, m
        self.record(best, chain)
        return best
