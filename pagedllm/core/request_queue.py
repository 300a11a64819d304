"""Waiting queues: first come first served, or by priority (lower value first, then arrival). Pure Python."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from pagedllm.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def append(self, req: Request) -> None:
        self._q.append(req)

    def prepend(self, req: Request) -> None:
        """A preempted request goes back to the front."""
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Ordered by (priority, arrival time): a preempted request keeps its place among its peers."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def append(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))

    prepend = append

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[3] is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"{req!r} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
