"""`pagedllm tp-worker`: a tensor-parallel rank > 0 started by hand (e.g. on another machine) for a rank 0 started
with ``--distributed-init-method``, or under torchrun. The rank's loop is ``pagedllm.worker.tp_worker``."""

from __future__ import annotations

from pagedllm.engine.arg_utils import add_engine_args, config_from_args, torchrun_env
from pagedllm.worker.tp_worker import run_worker


def add_args(p) -> None:
    """``pagedllm tp-worker``: rank 0's engine flags, plus this rank."""
    p.add_argument("--rank", type=int, default=None, help="this process's rank, 1..N-1 (default: $RANK)")
    p.add_argument("--world-size", type=int, default=None, help="N; same as --tensor-parallel-size")
    add_engine_args(p)


def main(args) -> int:
    """``pagedllm tp-worker --rank R --world-size N --distributed-init-method tcp://HOST:PORT [engine flags]``."""
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
