"""Replicas on one machine lending each other their idle cores (``pagedllm serve --data-parallel-size N``).

Each replica owns a share of the cores (its intra-op threads, ``torch.get_num_threads()`` when it starts). When a
sibling has nothing to run, its cores would sit idle while this replica's steps run on its own share alone: a lone
request on a 2 x 1-core pair decodes at one core's speed. So before each step a replica counts the cores of the
siblings that are idle and runs the step with its own threads plus theirs; when they are busy again it is back to
its own. The replicas' processes are not pinned to their cores then (their affinity is the set's cores), and the
threads of busy replicas add up to the cores there are, so the OS keeps one thread per core.

The shared state is one small file per replica in one directory (``core_share_file``: this replica's), mapped in
memory: this replica's core count, whether it is inside a step, and when its last step ended (CLOCK_MONOTONIC,
which every process of the machine reads alike). A sibling is idle when its engine said it has no request left
(``went_idle``), or when it is not inside a step and its last step ended over ``IDLE_AFTER_S`` ago (the short gaps
between the steps of a running generation do not count as idle).
A sibling that starts work while this replica runs a step on borrowed cores waits for nothing: between layers the
step gives back the cores of siblings that became busy (``give_back``, the decoder's ``between_layers``), so the two
overlap for at most a layer (a whole prefill step on borrowed cores overlapping a sibling's cost 14% of the pair's
throughput at 8 concurrent requests).
"""

from __future__ import annotations

import mmap
import os
import struct
import time

import torch

# cores (int64), inside a step (int64: 0 / 1), the last step's end (float64, time.monotonic())
_SLOT = struct.Struct("<qqd")
SUFFIX = ".cores"  # the replicas' files: NAME.cores in the shared directory
# a sibling whose last step ended longer ago than this (and that is not in a step) lends its cores
IDLE_AFTER_S = 0.05


def _map(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < _SLOT.size:
            os.ftruncate(fd, _SLOT.size)
        return mmap.mmap(fd, _SLOT.size)
    finally:
        os.close(fd)


class CoreShare:
    """This replica's slot and its view of its siblings' (the other files of ``path``'s directory)."""

    def __init__(self, path: str, own_threads: int | None = None) -> None:
        self.path = os.path.abspath(path)
        self.own = own_threads or torch.get_num_threads()
        self.mine = _map(self.path)
        self.mine[:] = _SLOT.pack(self.own, 1, 0.0)  # busy while it loads its model: ``end_step`` when ready
        self.siblings: dict[str, mmap.mmap] = {}
        self.threads = self.own
        self._listed = 0.0
        # counts since start (/health's runtime shows this dict as it is when asked)
        self.stats = {"own_threads": self.own, "steps": 0, "steps_on_borrowed_cores": 0, "cores_given_back": 0}

    def _sibling_slots(self, now: float):
        if now - self._listed > 1.0:  # a sibling that started later (or was started again) shows up within 1 s
            self._listed = now
            folder = os.path.dirname(self.path)
            try:
                names = sorted(os.listdir(folder))
            except OSError:  # the folder removed under a running replica (a tmp cleaner): the siblings it knows
                names = []
            for name in names:
                p = os.path.join(folder, name)
                if name.endswith(SUFFIX) and p != self.path and p not in self.siblings:
                    try:
                        if os.path.getsize(p) >= _SLOT.size:
                            self.siblings[p] = _map(p)
                    except OSError:
                        continue
        for m in self.siblings.values():
            yield _SLOT.unpack(m[:_SLOT.size])

    def lendable(self, now: float | None = None) -> int:
        """The cores of the siblings that are idle now."""
        now = time.monotonic() if now is None else now
        return sum(cores for cores, busy, ended in self._sibling_slots(now)
                   if not busy and now - ended > IDLE_AFTER_S)

    def begin_step(self) -> int:
        """Marks this replica busy and sets its threads for the step: its own plus the idle siblings' cores."""
        now = time.monotonic()
        self.mine[:] = _SLOT.pack(self.own, 1, now)
        self._set(self.own + self.lendable(now))
        self.stats["steps"] += 1
        self.stats["steps_on_borrowed_cores"] += self.threads > self.own
        return self.threads

    def give_back(self) -> None:
        """Inside a step on borrowed cores (between its layers): back to the cores still idle, when a sibling has
        started work since, so the two overlap for at most a layer."""
        if self.threads != self.own:
            before = self.threads
            self._set(min(self.threads, self.own + self.lendable()))
            self.stats["cores_given_back"] += before - self.threads

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads

    def end_step(self) -> None:
        self.mine[:] = _SLOT.pack(self.own, 0, time.monotonic())

    def went_idle(self) -> None:
        """No request left: idle from now on, not a gap between steps (siblings borrow at once)."""
        self.mine[:] = _SLOT.pack(self.own, 0, 0.0)

    def close(self) -> None:
        self.went_idle()  # its cores are free once it is gone (until it is started again)
        for m in (self.mine, *self.siblings.values()):
            m.close()
        self.siblings.clear()
