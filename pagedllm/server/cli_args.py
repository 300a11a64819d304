"""The `serve` command: the server's flags, and running the server they describe (engines, metrics, fallback, a
uvicorn server that drains on SIGTERM/SIGINT and stops when a tensor-parallel rank dies)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time

from pagedllm.config import DEFAULT_MODEL_FILE
from pagedllm.engine.arg_utils import add_engine_args, config_from_args
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.routing import POLICIES
from pagedllm.server.app import build_app
from pagedllm.server.data_parallel import replica_endpoint, run_data_parallel
from pagedllm.server.degradation import CircuitBreaker, FaultInjection
from pagedllm.server.kv_events import KVEventPublisher, KVEventsConfig
from pagedllm.server.middleware import MAX_BODY_BYTES
from pagedllm.server.reasoning import REASONING_PARSERS
from pagedllm.server.tools import TOOL_CALL_PARSERS

logger = logging.getLogger("pagedllm.server")


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="name clients use (default: the model's name)")
    g.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"),
                   help="require this bearer key on every route but /health (and /metrics, see below); "
                        "/v1/messages also takes it as x-api-key")
    g.add_argument("--metrics-require-auth", action="store_true", help="with --api-key, /metrics needs the key too")
    g.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: requests in flight get this long to finish, then are ended (finish "
                        "reason 'abort') and the process exits")
    g.add_argument("--max-request-body-bytes", type=int, default=MAX_BODY_BYTES)
    g.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between stats log lines")
    g.add_argument("--uvicorn-log-level", default="warning")
    g.add_argument("--fallback-model", default=None,
                   help="a second (smaller) model served when the primary fails, times out or its circuit is open")
    g.add_argument("--request-timeout-s", type=float, default=None,
                   help="a request that has no first token from the primary by then goes to the fallback")
    g.add_argument("--circuit-breaker-threshold", type=int, default=5, help="failures that open the circuit")
    g.add_argument("--circuit-breaker-window-s", type=float, default=60.0)
    g.add_argument("--circuit-breaker-cooldown-s", type=float, default=30.0, help="open -> half-open after this")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file used instead of the model's (e.g. one that renders tools)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto": the model decides, its calls are parsed (--tool-call-parser)')
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="hermes: <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> blocks (Qwen2.5, "
                        "Hermes-style templates); openai: gpt-oss's harmony tool messages (with --reasoning-parser "
                        "openai_gptoss)")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split <think>...</think> reasoning out of chat answers: message.reasoning_content (and "
                        "delta.reasoning_content) on /v1/chat/completions, a thinking block on /v1/messages; "
                        "deepseek_r1: the template opened <think> (no </think>: all reasoning); qwen3: optional "
                        "<think> (no </think>: all content); openai_gptoss: gpt-oss's harmony channels (analysis: "
                        "reasoning, final: content)")
    g.add_argument("--structured-outputs-in-reasoning", action="store_true",
                   help="with --reasoning-parser: a structured-output constraint (response_format, guided_*, a "
                        "required or named tool choice) covers the whole output, reasoning included; by default it "
                        "applies to the answer after </think> (vLLM's enable_in_reasoning)")
    g.add_argument("--kv-events-config", default=None,
                   help='publish the prefix cache\'s block stored / removed events as vLLM does, e.g. '
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\' '
                        "(for vllm-router's kv_aware policy, llm-d's prefix-cache scorer)")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="N engine replicas on this machine, each a process on its share of the cores, behind one "
                        "port that routes each request to one of them (--data-parallel-policy)")
    g.add_argument("--data-parallel-lend-cores", action=argparse.BooleanOptionalAction, default=True,
                   help="replicas lend each other their cores while idle: a step runs on its replica's share of the "
                        "cores plus those of the replicas that have nothing to run (off: each replica pinned to its "
                        "share)")
    g.add_argument("--data-parallel-policy", choices=POLICIES, default="cache_aware",
                   help="cache_aware: a request goes to the replica that was sent the longest start of its text "
                        "(its prefix cache holds it) unless that one is much busier than the least busy, else to the "
                        "least busy; round_robin: each in turn")
    g.add_argument("--fault-injection", default=os.environ.get("PAGEDLLM_FAULT_INJECTION"),
                   help='tests only: \'{"fail_marker": "...", "stall_marker": "..."}\' makes the primary fail or '
                        "stall on prompts containing the marker")


def add_ray_serve_args(p: argparse.ArgumentParser) -> None:
    """`pagedllm ray-serve`'s flags: the server's, the engine's and Ray Serve's own (the deployment is in
    ``ray_serve``, which imports Ray)."""
    add_server_args(p)
    add_engine_args(p)
    g = p.add_argument_group("Ray Serve")
    g.add_argument("--ray-address", default=None,
                   help="a running Ray cluster ('auto': the one this machine joined with `ray start`); default: start "
                        "a local one for this command")
    g.add_argument("--num-replicas", type=int, default=1, help="replicas (without --max-replicas)")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (default 1)")
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscaling: most replicas; Serve adds and removes replicas to keep "
                        "--target-ongoing-requests in flight on each")
    g.add_argument("--target-ongoing-requests", type=float, default=16.0,
                   help="autoscaling: requests in flight per replica that Serve aims at")
    g.add_argument("--num-cpus-per-replica", type=float, default=None,
                   help="CPUs each replica asks Ray for (its threads); default: this machine's cores shared by "
                        "--num-replicas (1 with autoscaling)")


def default_served_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_MODEL_FILE.split(".")[0]
    return model


@dataclasses.dataclass
class ServerParts:
    """What one server runs: its app and the engines and publisher behind it (to stop on exit)."""

    app: object  # the FastAPI app
    name: str  # the served model name
    engine: AsyncLLM
    fallback: AsyncLLM | None = None
    publisher: KVEventPublisher | None = None

    def close(self) -> None:
        self.engine.shutdown()
        if self.fallback is not None:
            self.fallback.shutdown()
        if self.publisher is not None:
            self.publisher.close()


def check_server_args(args: argparse.Namespace):
    """The engine config the serve flags describe, checked (a flag the engine cannot honour is a ValueError with
    its message), with the KV-events and fault-injection settings."""
    config = config_from_args(args)
    kv_events = KVEventsConfig.parse(args.kv_events_config)
    if kv_events is not None:
        if not config.cache.enable_prefix_caching:
            raise ValueError("--kv-events-config describes the prefix cache: it needs prefix caching on")
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_kv_cache_events=True))
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return config, kv_events, FaultInjection.parse(args.fault_injection)


def build_server(args: argparse.Namespace, replica_index: int | None = None) -> ServerParts:
    """The engine(s) and the app of one server from its flags (``replica_index``: this server is that replica of a
    set, which moves its KV-events endpoint)."""
    config, kv_events, faults = check_server_args(args)
    if kv_events is not None and replica_index is not None:
        kv_events = dataclasses.replace(
            kv_events, endpoint=replica_endpoint(kv_events.endpoint, replica_index),
            replay_endpoint=kv_events.replay_endpoint and replica_endpoint(kv_events.replay_endpoint, replica_index))
    chat_template = None
    if args.chat_template:
        with open(args.chat_template) as f:
            chat_template = f.read()
    name = args.served_model_name or default_served_name(args.model)
    engine = AsyncLLM(config, log_stats_interval=args.log_stats_interval)
    if faults is not None and faults.forward_fail_token is not None:
        engine.inject_forward_fault(faults.forward_fail_token)
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template
    kv = engine.kv_cache_spec()
    metrics = PrometheusStatLogger(name, kv.total_bytes, kv.num_tokens, kv.bytes_per_block)
    engine.stat_loggers.append(metrics)
    publisher = None
    if kv_events is not None:
        publisher = KVEventPublisher(kv_events, config.cache.block_size)
        engine.stat_loggers.append(publisher)
        logger.info("publishing KV-cache events on %s", kv_events.endpoint)
    fallback = fallback_name = breaker = None
    if args.fallback_model:
        fb_config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, model=args.fallback_model, served_model_name=None),
            speculative=None, tensor_parallel_size=1)
        fallback = AsyncLLM(fb_config, log_stats_interval=args.log_stats_interval)
        fallback_name = os.path.basename(os.path.normpath(args.fallback_model)).split(".")[0]
        if fallback_name == name:
            fallback_name = f"{name}-fallback"
        breaker = CircuitBreaker(args.circuit_breaker_threshold, args.circuit_breaker_window_s,
                                 args.circuit_breaker_cooldown_s)
    app = build_app(engine, [name], api_key=args.api_key, max_body_bytes=args.max_request_body_bytes,
                    metrics=metrics, fallback=fallback, fallback_name=fallback_name, breaker=breaker,
                    request_timeout_s=args.request_timeout_s, faults=faults,
                    auto_tools=args.enable_auto_tool_choice, metrics_require_auth=args.metrics_require_auth,
                    reasoning_parser=args.reasoning_parser,
                    structured_in_reasoning=args.structured_outputs_in_reasoning,
                    tool_call_parser=args.tool_call_parser)
    return ServerParts(app, name, engine, fallback, publisher)


def run_server(args: argparse.Namespace, replica_index: int | None = None) -> int:
    """Serve until a signal; ``replica_index``: this server is that replica of a --data-parallel-size set."""
    import uvicorn  # optional and heavy: only the server needs it

    logging.getLogger("pagedllm").setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "data_parallel_size", 1) != 1:
        check_server_args(args)  # a bad flag stops here, once; each replica builds its own engine
        return run_data_parallel(args)
    parts = build_server(args, replica_index)
    app, engine, fallback = parts.app, parts.engine, parts.fallback
    drain_s = args.drain_timeout_s

    class _Server(uvicorn.Server):
        drain_timer: threading.Timer | None = None

        def handle_exit(self, sig, frame):  # graceful stop, then a normal exit (no re-raised signal)
            if app.state.draining:  # a second signal: stop listening now
                super().handle_exit(sig, frame)
                self._captured_signals.clear()
                return
            self._captured_signals.clear()
            # still listening while the requests in flight finish: /health says 503 and new work gets 503, so
            # routers and load balancers move on; then uvicorn stops (requests still running when the drain time
            # is up are ended)
            app.state.draining = True
            logger.info("stopping: requests in flight have %.0f s to finish", drain_s)
            self.drain_timer = threading.Timer(drain_s, _end_in_flight)
            self.drain_timer.daemon = True
            self.drain_timer.start()
            threading.Thread(target=self._stop_when_idle, daemon=True).start()

        def _stop_when_idle(self) -> None:
            def busy(e: AsyncLLM) -> bool:
                s = e.stats()
                return e.is_alive and s.num_running + s.num_waiting + s.num_swapped > 0

            while any(busy(e) for e in (engine, fallback) if e is not None):
                time.sleep(0.05)
            self.should_exit = True  # what handle_exit does (without recording a signal to re-raise at exit)

    def _end_in_flight() -> None:
        logger.warning("drain timeout (%.0f s): ending the requests still in flight", drain_s)
        engine.shutdown()
        if fallback is not None:
            fallback.shutdown()

    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                    timeout_graceful_shutdown=drain_s + 5))
    tp_failures: list[str] = []

    def _tp_failed(message: str) -> None:  # a tensor-parallel rank that dies takes the server down (the watchdog)
        logger.critical("stopping the server: %s", message)
        tp_failures.append(message)
        server.should_exit = True

    engine.add_tp_failure_callback(_tp_failed)  # False (nothing to watch) without tensor parallelism
    logger.info("serving %s on http://%s:%d", parts.name, args.host, args.port)
    server.run()
    if server.drain_timer is not None:
        server.drain_timer.cancel()
    parts.close()
    if tp_failures:
        print(f"error: tensor parallelism failed: {tp_failures[0]}", file=sys.stderr)
        return 1
    logger.info("server stopped")
    return 0


def _replica_main() -> int:
    """A replica of `pagedllm serve --data-parallel-size N` (started by ``data_parallel.ReplicaSet``): the serve
    flags, its port and index come as JSON on stdin; it stops (draining) when its parent process goes away."""
    payload = json.loads(sys.stdin.read())
    index, parent = payload["index"], payload["parent_pid"]
    args = argparse.Namespace(**payload["args"])
    args.host, args.port, args.data_parallel_size = "127.0.0.1", payload["port"], 1
    logging.basicConfig(level=str(getattr(args, "log_level", "warning")).upper(),
                        format=f"%(asctime)s %(levelname)s replica{index} %(name)s: %(message)s")

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        logger.warning("the balancer (pid %d) is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch_parent, daemon=True).start()
    try:
        return run_server(args, replica_index=index)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: replica {index}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_replica_main())
