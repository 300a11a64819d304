"""Ranks 1..N-1: build this rank's shard of the model and of the KV cache, then run each step rank 0 sends until
rank 0 shuts the group down.

Started by the engine on its own machine (``python -m pagedllm.distributed.worker``, the engine config on stdin),
or by hand on another machine with ``pagedllm tp-worker`` (rank 0's engine flags plus ``--rank`` and
``--distributed-init-method``).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys
import threading
import time

from pagedllm.config import EngineConfig
from pagedllm.errors import TensorParallelError

logger = logging.getLogger(__name__)


def run_worker(config: EngineConfig, rank: int, store=None) -> int:
    """Serve rank ``rank`` until rank 0 shuts down (0) or the group fails (1)."""
    from pagedllm.worker.model_runner import ModelRunner

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


def add_args(p) -> None:
    """``pagedllm tp-worker``: rank 0's engine flags, plus this rank."""
    from pagedllm.engine.arg_utils import add_engine_args

    p.add_argument("--rank", type=int, default=None, help="this process's rank, 1..N-1 (default: $RANK)")
    p.add_argument("--world-size", type=int, default=None, help="N; same as --tensor-parallel-size")
    add_engine_args(p)


def main(args) -> int:
    """``pagedllm tp-worker --rank R --world-size N --distributed-init-method tcp://HOST:PORT [engine flags]``."""
    from pagedllm.engine.arg_utils import config_from_args, torchrun_env

    if args.world_size is not None:
        args.tensor_parallel_size = args.world_size
    env = torchrun_env()
    rank = args.rank if args.rank is not None else (env["rank"] if env else None)
    if rank is None:
        raise ValueError("give --rank (1..N-1), or start the worker under torchrun")
    config = config_from_args(args)
    if config.parallel.distributed_init_method is None:
        raise ValueError("a hand-started worker needs --distributed-init-method tcp://HOST:PORT (rank 0's address)")
    return run_worker(config, rank)


def spawned_main() -> int:
    """Entry of a worker the engine started on its own machine (``python -m pagedllm.distributed.worker``)."""
    import torch.distributed as dist

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
