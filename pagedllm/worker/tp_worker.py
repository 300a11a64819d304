"""Ranks 1..N-1: build this rank's shard of the model and of the KV cache, then run each step rank 0 sends until
rank 0 shuts the group down.

Started by the engine on its own machine (``python -m pagedllm.worker.tp_worker``, the engine config on stdin),
or by hand on another machine with ``pagedllm tp-worker`` (``pagedllm.cli.tp_worker``: rank 0's engine flags plus
``--rank`` and ``--distributed-init-method``).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys
import threading
import time

import torch.distributed as dist

from pagedllm.config import EngineConfig
from pagedllm.errors import TensorParallelError
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def run_worker(config: EngineConfig, rank: int, store=None) -> int:
    """Serve rank ``rank`` until rank 0 shuts down (0) or the group fails (1)."""
    if not 0 < rank < config.tensor_parallel_size:
        raise ValueError(f"a worker's rank must be in [1, {config.tensor_parallel_size}), got {rank}")
    runner = ModelRunner(config, rank=rank, store=store)
    try:
        runner.serve_steps()
    except TensorParallelError as e:
        logger.error("rank %d stops: %s", rank, e)
        return 1
    finally:
        runner.shutdown()
    return 0


def _exit_with_parent(parent_pid: int) -> None:
    """A local worker must not outlive the engine that started it."""

    def loop() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=loop, name="pagedllm-parent-watch", daemon=True).start()


def spawned_main() -> int:
    """Entry of a worker the engine started on its own machine (``python -m pagedllm.worker.tp_worker``)."""
    msg = pickle.load(sys.stdin.buffer)
    config: EngineConfig = msg["config"]
    rank: int = msg["rank"]
    logging.basicConfig(level=msg.get("log_level", logging.WARNING),
                        format=f"%(asctime)s %(levelname)s [tp rank {rank}] %(name)s: %(message)s")
    _exit_with_parent(msg["parent_pid"])
    host, port = msg["store"]
    store = dist.TCPStore(host, port, config.tensor_parallel_size, is_master=False,
                          timeout=datetime.timedelta(seconds=config.parallel.timeout_s))
    store.set(f"pagedllm/joined/{rank}", "1")
    try:
        return run_worker(config, rank, store)
    except Exception:  # noqa: BLE001 - logged here; rank 0 sees this process exit
        logger.exception("tensor-parallel worker rank %d failed", rank)
        return 1


if __name__ == "__main__":
    sys.exit(spawned_main())
