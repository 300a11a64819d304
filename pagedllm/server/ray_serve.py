"""Ray Serve: pagedllm replicas as a Serve deployment, each replica actor one engine with the whole OpenAI-compatible
app, behind Serve's HTTP proxy; a fixed replica count or autoscaling on requests in flight per replica.

    pagedllm ray-serve --num-replicas 2 [serve flags]                 # starts a local Ray cluster for the command
    pagedllm ray-serve --ray-address auto --min-replicas 1 --max-replicas 8   # on the head of a running cluster
    serve run pagedllm.server.ray_serve:app_builder num_replicas=2 model=/models/m.gguf   # Serve's own CLI

Each replica asks Ray for ``--num-cpus-per-replica`` CPUs (Ray sets a replica's OMP_NUM_THREADS to them, and torch
sizes its thread pool from that). Needs ``pip install "ray[serve]"`` (the ``ray`` extra).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

import ray
from ray import serve

from pagedllm.server.cli_args import ServerParts, add_ray_serve_args, build_server, check_server_args

logger = logging.getLogger("pagedllm.server")

REPLICA_HEADER = "x-pagedllm-replica"


@serve.deployment(name="pagedllm")
@serve.ingress()
class PagedLLMDeployment:
    """One Serve replica: the engine and app ``pagedllm serve`` would build from the same flags."""

    def __init__(self, serve_args: dict) -> None:
        logging.getLogger("pagedllm").setLevel(logging.INFO)
        self.parts: ServerParts = build_server(argparse.Namespace(**serve_args))
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self):
        return _NameReplica(self.parts.app, self.replica_id)

    def __del__(self) -> None:
        """Serve calls it when the replica stops: its engines and its KV-event publisher (a ZMQ socket) close."""
        parts = getattr(self, "parts", None)
        if parts is not None:
            parts.close()

    def check_health(self) -> None:
        """Serve's health probe: a replica whose engine loop stopped is restarted."""
        if not self.parts.engine.is_alive:
            raise RuntimeError("the engine loop is not running")


class _NameReplica:
    """ASGI: adds which replica answered (``x-pagedllm-replica``) to every response."""

    def __init__(self, app, replica_id: str) -> None:
        self.app, self.value = app, replica_id.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named_send(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), (REPLICA_HEADER.encode(), self.value)])
            await send(message)

        return await self.app(scope, receive, named_send)


def deployment_options(args: argparse.Namespace) -> dict:
    """Serve options of the deployment: replicas or autoscaling, CPUs per replica, requests a replica takes."""
    opts: dict = {"max_ongoing_requests": 4 * args.max_num_seqs}  # the engine queues (and bounds) the rest
    if args.max_replicas is not None:
        low = 1 if args.min_replicas is None else args.min_replicas
        if not 0 <= low <= args.max_replicas or args.max_replicas < 1:
            raise ValueError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, got "
                             f"{low} and {args.max_replicas}")
        opts["autoscaling_config"] = {"min_replicas": low, "max_replicas": args.max_replicas,
                                      "target_ongoing_requests": args.target_ongoing_requests}
        cpus = args.num_cpus_per_replica or 1.0
    else:
        if args.min_replicas is not None:
            raise ValueError("--min-replicas goes with --max-replicas (autoscaling)")
        if args.num_replicas < 1:
            raise ValueError(f"--num-replicas must be >= 1, got {args.num_replicas}")
        opts["num_replicas"] = args.num_replicas
        cpus = args.num_cpus_per_replica or max(1.0, float((os.cpu_count() or 1) // args.num_replicas))
    if cpus <= 0:
        raise ValueError(f"--num-cpus-per-replica must be > 0, got {cpus}")
    opts["ray_actor_options"] = {"num_cpus": cpus}
    return opts


def build_application(args: argparse.Namespace):
    """The Serve application for these flags (checked here, before any replica starts)."""
    if getattr(args, "data_parallel_size", 1) != 1 or getattr(args, "tensor_parallel_size", 1) not in (None, 1):
        raise ValueError("under Ray Serve, scale with --num-replicas / --max-replicas (not --data-parallel-size or "
                         "--tensor-parallel-size)")
    check_server_args(args)
    serve_args = {k: v for k, v in vars(args).items() if not callable(v)}
    return PagedLLMDeployment.options(**deployment_options(args)).bind(serve_args)


def app_builder(cli_args: dict):
    """``serve run pagedllm.server.ray_serve:app_builder key=value ...``: the keys are `pagedllm ray-serve`'s flags
    with underscores (``model=...``, ``num_replicas=2``, ``max_num_seqs=32``); a flag without a value: ``=true``."""
    p = argparse.ArgumentParser(prog="pagedllm.server.ray_serve:app_builder")
    add_ray_serve_args(p)
    argv: list[str] = []
    for key, value in cli_args.items():
        flag = "--" + key.replace("_", "-")
        if str(value).lower() == "true":
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return build_application(p.parse_args(argv))


def main(args: argparse.Namespace) -> int:
    """`pagedllm ray-serve`: deploy on the Ray cluster (a local one unless --ray-address) and serve until a signal."""
    app = build_application(args)
    ray.init(address=args.ray_address, include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name="pagedllm", route_prefix="/")
        logger.info("serving on http://%s:%d through Ray Serve", args.host, args.port)
        stop.wait()
        logger.info("stopping: Serve drains its replicas")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
