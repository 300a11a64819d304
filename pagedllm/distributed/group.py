"""The tensor-parallel process group: torch.distributed (gloo on CPU, NCCL on CUDA) behind a small object.

Two groups join the same ranks:
- the *model* group (the default group: NCCL on CUDA, gloo on CPU, timeout ``timeout_s``) carries the model's
  all-reduces and all-gathers;
- the *control* group (always gloo, CPU tensors) carries each step's inputs from rank 0 to the others. Its timeout
  is very long because a worker waits on it while the engine is idle; a rank that dies closes its connections,
  which fails the others' pending operations at once.

A failed collective leaves the ranks out of step, so every failure is final: it is recorded, raised as
``TensorParallelError``, and every later call raises it again.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from pagedllm.errors import TensorParallelError

logger = logging.getLogger(__name__)

CMD_STEP = 1
CMD_SHUTDOWN = 2
_HEADER = 4  # int64 words: command, payload length, reserved
CONTROL_TIMEOUT = datetime.timedelta(days=3650)


def init_tp_group(world_size: int, rank: int, device: torch.device, timeout_s: float,
                  init_method: str | None = None, store: dist.Store | None = None) -> "TPGroup":
    """Join (or, on rank 0, host) the process group: through ``store`` (local workers) or ``init_method``
    (``tcp://HOST:PORT`` or ``env://`` under torchrun). Blocks until every rank has joined."""
    if dist.is_initialized():
        raise ValueError("a torch.distributed process group already exists in this process: only one "
                         "tensor-parallel engine can run per process (shut the other one down first)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"store": store} if store is not None else {"init_method": init_method}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, world_size, device, control)


class TPGroup:
    """rank / world_size, the model's collectives, and the step channel from rank 0 to the workers."""

    def __init__(self, rank: int, world_size: int, device: torch.device, control) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._control = control
        self.failure: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        # set by the local-worker supervisor: the failure of a worker process it saw exit, if any
        self.explain_failure: Callable[[float], str | None] = lambda wait_s: None
        # communication counters (wall time spent in the model's collectives, waiting for slower ranks included)
        self.time_collectives = device.type == "cpu"  # timing a CUDA collective needs a synchronize
        self.all_reduce_seconds = 0.0
        self.all_gather_seconds = 0.0
        self.num_all_reduces = 0
        self.num_all_gathers = 0

    # ------------------------------------------------------------------ failure
    def add_failure_callback(self, cb: Callable[[str], None]) -> None:
        self._callbacks.append(cb)
        if self.failure is not None:
            cb(self.failure)

    def fail(self, message: str) -> None:
        """Record the group's (first) failure and tell the callbacks; later calls raise it."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = message
        logger.error("tensor parallelism failed: %s", message)
        for cb in self._callbacks:
            try:
                cb(message)
            except Exception:  # noqa: BLE001 - a callback must not hide the failure
                logger.exception("failure callback raised")

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def _collective(self, what: str, fn, *args, **kwargs):
        self.check()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any failure here breaks the group for good
            reason = self.explain_failure(2.0) or f"rank {self.rank}: {what} failed: {type(e).__name__}: {e}"
            self.fail(reason)
            raise TensorParallelError(reason) from e

    # ------------------------------------------------------------------ model collectives
    @contextlib.contextmanager
    def _timed(self, counter: str):
        """Add the block's wall time to ``counter`` (only on CPU, where collectives are synchronous)."""
        if not self.time_collectives:
            yield
            return
        t0 = time.perf_counter()
        yield
        setattr(self, counter, getattr(self, counter) + time.perf_counter() - t0)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns it."""
        with self._timed("all_reduce_seconds"):
            self._collective("all_reduce", dist.all_reduce, t)
        self.num_all_reduces += 1
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``t``, concatenated in rank order along ``dim``."""
        with self._timed("all_gather_seconds"):
            t = t.contiguous()
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            self._collective("all_gather", dist.all_gather, parts, t)
            out = torch.cat(parts, dim=dim)
        self.num_all_gathers += 1
        return out

    # ------------------------------------------------------------------ control channel (CPU, gloo)
    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of ints (same length on every rank), in rank order. For start-up agreement."""
        t = torch.tensor(values, dtype=torch.long)
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self._collective("start-up all_gather", dist.all_gather, parts, t, group=self._control)
        return [p.tolist() for p in parts]

    def _send(self, cmd: int, payload: torch.Tensor | None) -> None:
        header = torch.zeros(_HEADER, dtype=torch.long)
        header[0] = cmd
        header[1] = 0 if payload is None else payload.numel()
        self._collective("step broadcast", dist.broadcast, header, 0, group=self._control)
        if payload is not None and payload.numel():
            self._collective("step broadcast", dist.broadcast, payload, 0, group=self._control)

    def send_step(self, payload: torch.Tensor) -> None:
        """Rank 0: hand the step's inputs (a 1-D int64 CPU tensor) to every other rank."""
        self._send(CMD_STEP, payload.to(torch.long).contiguous())

    def recv(self) -> torch.Tensor | None:
        """Ranks > 0: wait for rank 0's next step; None when rank 0 shuts the group down."""
        header = torch.zeros(_HEADER, dtype=torch.long)
        self._collective("waiting for rank 0", dist.broadcast, header, 0, group=self._control)
        cmd, n = int(header[0]), int(header[1])
        if cmd == CMD_SHUTDOWN:
            return None
        if cmd != CMD_STEP:
            raise TensorParallelError(f"rank {self.rank}: unknown command {cmd} from rank 0")
        payload = torch.empty(n, dtype=torch.long)
        if n:
            self._collective("waiting for rank 0", dist.broadcast, payload, 0, group=self._control)
        return payload

    def shutdown_workers(self) -> None:
        """Rank 0: tell the workers to leave their loop (best effort: a failed group has nobody to tell)."""
        if self.failure is None and self.world_size > 1:
            try:
                self._send(CMD_SHUTDOWN, None)
            except TensorParallelError:
                pass

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may fail to tear down; nothing left to do
                logger.debug("destroy_process_group failed", exc_info=True)
