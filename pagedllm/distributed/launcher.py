"""Starting the tensor-parallel ranks and watching the local ones.

- One machine (no init method given): rank 0 hosts a rendezvous store on a free localhost port and starts ranks
  1..N-1 as child processes (``python -m pagedllm.worker.tp_worker``; the engine config goes over the child's
  stdin). A watchdog thread polls them: one that exits fails the group at once (the engine's next or current step
  raises ``TensorParallelError`` naming the rank and its exit code), idle or not.
- Several machines: every rank joins through ``init_method`` (``tcp://HOST:PORT``, or ``env://`` under torchrun);
  ranks > 0 are started by hand with ``pagedllm tp-worker``. A remote rank that dies closes its connections, so
  the next collective fails at once; one that hangs fails it after the timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from pagedllm.config import EngineConfig
from pagedllm.distributed.group import TPGroup, init_tp_group
from pagedllm.errors import TensorParallelError

logger = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"


def threads_per_rank(config: EngineConfig) -> int:
    """Intra-op threads of each rank: as configured, else the machine's cores shared out between the ranks."""
    n = config.parallel.threads_per_rank
    return n if n else max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of ``rank``: on CUDA without an explicit index, GPU ``rank`` modulo the GPUs present."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    return device


def join_tensor_parallel(config: EngineConfig, rank: int, device: torch.device,
                         store: dist.Store | None = None) -> tuple[TPGroup, "LocalWorkers | None"]:
    """Join the group as ``rank``: rank 0 without an init method starts the local workers first."""
    torch.set_num_threads(threads_per_rank(config))
    world = config.tensor_parallel_size
    p = config.parallel
    if rank == 0 and store is None and p.distributed_init_method is None:
        workers = LocalWorkers(config)
        try:
            workers.wait_joined(p.timeout_s)
            tp = init_tp_group(world, 0, device, p.timeout_s, store=workers.store)
        except BaseException:
            workers.stop()
            raise
        workers.watch(tp)
        return tp, workers
    if rank == 0:
        logger.info("tensor parallelism: waiting for %d more rank(s) at %s", world - 1, p.distributed_init_method)
    return init_tp_group(world, rank, device, p.timeout_s, init_method=p.distributed_init_method, store=store), None


def _describe_exit(rank: int, proc: subprocess.Popen) -> str:
    code = proc.returncode
    how = f"exit code {code}"
    if code is not None and code < 0:
        try:
            how += f" (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"tensor-parallel worker rank {rank} (pid {proc.pid}) died with {how}; its log is above"


class LocalWorkers:
    """Ranks 1..N-1 as child processes of this one, supervised by a watchdog thread."""

    def __init__(self, config: EngineConfig, poll_s: float = 0.2) -> None:
        world = config.tensor_parallel_size
        self.poll_s = poll_s
        self.store = dist.TCPStore(LOCALHOST, 0, world, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=config.parallel.timeout_s))
        self.procs: dict[int, subprocess.Popen] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # the children import this very pagedllm, installed or not
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        for rank in range(1, world):
            proc = subprocess.Popen([sys.executable, "-m", "pagedllm.worker.tp_worker"], stdin=subprocess.PIPE,
                                    env=env)
            proc.stdin.write(pickle.dumps({"config": config, "rank": rank, "store": (LOCALHOST, self.store.port),
                                           "parent_pid": os.getpid(),
                                           "log_level": logging.getLogger("pagedllm").getEffectiveLevel()}))
            proc.stdin.close()
            self.procs[rank] = proc
        logger.info("tensor parallelism: started %d local worker(s), pids %s", len(self.procs),
                    [p.pid for p in self.procs.values()])

    def dead(self) -> str | None:
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                return _describe_exit(rank, proc)
        return None

    def explain(self, wait_s: float) -> str | None:
        """A worker that has exited (waiting up to ``wait_s`` for one to be seen exiting), described."""
        deadline = time.monotonic() + wait_s
        while True:
            msg = self.dead()
            if msg is not None or time.monotonic() >= deadline:
                return msg
            time.sleep(0.05)

    def wait_joined(self, timeout_s: float) -> None:
        """Block until every worker has reached the rendezvous; fail at once if one exits first."""
        keys = [f"pagedllm/joined/{r}" for r in self.procs]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            msg = self.dead()
            if msg is not None:
                raise TensorParallelError(f"{msg} (during start-up)")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not start within {timeout_s:.0f} s")
            time.sleep(0.05)

    def watch(self, tp: TPGroup) -> None:
        tp.explain_failure = self.explain

        def loop() -> None:
            while not self._stop.wait(self.poll_s):
                msg = self.dead()
                if msg is not None:
                    tp.fail(msg)
                    return

        self._thread = threading.Thread(target=loop, name="pagedllm-tp-watchdog", daemon=True)
        self._thread.start()

    def stop_watching(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop watching; wait for the workers to leave (after rank 0's shutdown message), then end them."""
        self.stop_watching()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(3)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
