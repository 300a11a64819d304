"""Command-line flags of the engine (vLLM's names), shared by `pagedllm generate/chat/serve` and the
`python -m pagedllm.entrypoints.openai.api_server` entry point.

The flags are generated from the config dataclasses' fields (``pagedllm.config.engine_options``): names, help
texts, choices and defaults are written there once."""

from __future__ import annotations

import argparse
import os

from pagedllm.config import EngineConfig, engine_options


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    for o in engine_options():
        if not o.cli:
            continue
        if o.type is bool:
            g.add_argument(o.flag, action=argparse.BooleanOptionalAction, default=o.default, help=o.help)
        else:
            g.add_argument(o.flag, type=None if o.type is str else o.type, default=o.default, choices=o.choices,
                           help=o.help)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config of parsed flags (options another layer's parser did not define take their defaults)."""
    values = {o.name: getattr(args, o.name) for o in engine_options() if hasattr(args, o.name)}
    values.update(_distributed_options(values))
    return EngineConfig.from_options(**values)


def torchrun_env() -> dict[str, int] | None:
    """RANK / WORLD_SIZE when this process was started by torchrun (or with its variables set by hand)."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def _distributed_options(values: dict) -> dict:
    """Under torchrun, the init method (env://) and the tensor-parallel size come from its variables."""
    tp, method = values.get("tensor_parallel_size", 1), values.get("distributed_init_method")
    env = torchrun_env()
    if method is None and env is not None and env["world_size"] > 1:
        method = "env://"
        if tp == 1:
            tp = env["world_size"]
        elif tp != env["world_size"]:
            raise ValueError(f"--tensor-parallel-size {tp} differs from torchrun's WORLD_SIZE {env['world_size']}")
    return {"tensor_parallel_size": tp, "distributed_init_method": method}
