"""`pagedllm serve --data-parallel-size N`: N engine replicas on one machine behind a prefix-aware balancer.

Each replica is a whole `pagedllm serve` in a child process on a loopback port, pinned to its share of the CPU cores
(torch's and the kernels' threads follow the affinity). This process answers the API port: it sends each request to
a replica, streams the answer back, answers /health for the set and serves the replicas' /metrics merged under an
``engine`` label (vLLM's label for a data-parallel rank). Routing (``--data-parallel-policy``):

- ``cache_aware`` (default): a request whose text starts as an earlier one did goes where that one went, so that
  replica's prefix cache holds the shared start (a system prompt, a conversation so far), unless that replica is
  busier than the least busy one by more than a slack; a request that matches nothing goes to the least busy
  (``pagedllm.routing``). The text is matched in 32-character chunks, as vllm-router's ``cache_aware`` policy
  matches text rather than tokens, so the balancer needs no tokenizer.
- ``round_robin``: each replica in turn.

A replica that dies is taken out of rotation (requests in flight on it get an error; a request that could not reach
it goes to another) and started again; one that dies 3 times within 5 minutes stays out, and when none is left the
server stops with an error. SIGTERM / SIGINT
drains: /health answers 503, new work gets 503, the replicas finish their requests in flight, then everything exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.metrics.prometheus import merge_expositions
from pagedllm.routing import ReplicaRouter
from pagedllm.server.errors import error_json, install_error_handlers
from pagedllm.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, DrainingMiddleware

logger = logging.getLogger("pagedllm.server")

ENGINE_HEADER = "x-pagedllm-engine"
# a replica whose process dies is started again, unless it died this often within the window: then it stays out
MAX_RESTARTS = 3
RESTART_WINDOW_S = 300.0
LOCALHOST = "127.0.0.1"
# request headers not passed on (the hop's own) and response headers the response object sets itself
_HOP_HEADERS = frozenset({"host", "connection", "keep-alive", "transfer-encoding", "content-length", "upgrade",
                          "proxy-connection", "te", "trailer"})


def core_groups(cores: list[int], n: int) -> list[list[int]]:
    """``cores`` split into ``n`` contiguous groups as even as they can be (the first ones take the remainder)."""
    if n < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {n}")
    if n > len(cores):
        raise ValueError(f"--data-parallel-size {n} needs at least {n} CPU cores; this process may use "
                         f"{len(cores)} ({cores})")
    q, r = divmod(len(cores), n)
    out, start = [], 0
    for i in range(n):
        size = q + (1 if i < r else 0)
        out.append(cores[start:start + size])
        start += size
    return out


def routing_text(body: bytes) -> str | None:
    """The part of a request body that a replica's prefix cache keys on, as text: the system prompt / instructions,
    then the messages, prompt or input (JSON-encoded, so a shared start stays a shared start). None: not JSON."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    parts = [obj[k] for k in ("system", "instructions", "messages", "prompt", "input") if k in obj]
    return json.dumps(parts, ensure_ascii=False) if parts else None


CHUNK_CHARS = 32  # characters per hashed chunk of a request's text (about 8 tokens)
MAX_CHARS = 16384  # the start that is matched (a longer text's tail does not move it)


def text_chain(text: str | None) -> list[int] | None:
    """The chained hashes of ``text``'s whole 32-character chunks (what ``ReplicaRouter`` matches)."""
    if text is None:
        return None
    out, h = [], 0
    for i in range(0, min(len(text), MAX_CHARS) - CHUNK_CHARS + 1, CHUNK_CHARS):
        h = hash((h, text[i:i + CHUNK_CHARS]))
        out.append(h)
    return out


@dataclass
class Replica:
    index: int
    cores: list[int]
    port: int
    proc: subprocess.Popen | None = None
    healthy: bool = False  # answered /health 200 at the last poll
    exited: bool = False
    in_flight: int = 0
    routed: int = 0  # requests sent to it so far
    restarts: list[float] = field(default_factory=list)  # when it was restarted (time.monotonic())

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


class ReplicaSet:
    """The replicas' child processes: started with their cores and ports, polled for health, stopped together."""

    def __init__(self, args, n: int, policy: str) -> None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
        self.cores = cores
        self.replicas = [Replica(i, g, _free_port()) for i, g in enumerate(core_groups(cores, n))]
        # where the replicas say which of them are idle (``worker.core_share``), when they lend each other cores
        self.share_dir = (tempfile.mkdtemp(prefix="pagedllm-cores-")
                          if n > 1 and getattr(args, "data_parallel_lend_cores", False) else None)
        self.policy = policy
        self.router = ReplicaRouter(n, policy)
        self._args = args
        self.failed: str | None = None  # set when no replica is left
        self.stopping = False  # a drain was asked for: replicas exiting is expected

    # -- processes -------------------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 600.0) -> None:
        for r in self.replicas:
            self._spawn(r)
        logger.info("data parallelism: %d replicas (cores %s, pids %s), policy %s", len(self.replicas),
                    [r.cores for r in self.replicas], [r.proc.pid for r in self.replicas], self.policy)
        deadline = time.monotonic() + timeout_s
        try:
            pending = list(self.replicas)
            while pending:
                for r in list(pending):
                    if r.proc.poll() is not None:
                        raise RuntimeError(f"replica {r.index} (pid {r.proc.pid}) exited with code "
                                           f"{r.proc.returncode} while starting; its log is above")
                    with contextlib.suppress(httpx.HTTPError):
                        if httpx.get(r.url + "/health", timeout=1.0).status_code == 200:
                            r.healthy = True
                            pending.remove(r)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replicas {[r.index for r in pending]} did not start within {timeout_s:.0f} s")
                time.sleep(0.2)
        except BaseException:
            self.kill()
            self.remove_files()
            raise

    def _spawn(self, r: Replica) -> None:
        """Start replica ``r``'s process: pinned to its cores from the start (torch sizes its thread pool from the
        affinity; lending cores, on all the set's cores with its share as its threads), in a session of its own (a
        terminal's Ctrl-C reaches this process only, which then drains the replicas); its flags, port and index as
        JSON on its stdin."""
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
                   OMP_NUM_THREADS=str(len(r.cores)))
        r.proc = subprocess.Popen([sys.executable, "-m", "pagedllm.server.cli_args"], stdin=subprocess.PIPE, env=env,
                                  start_new_session=True, preexec_fn=_pin(self.cores if self.share_dir else r.cores))
        args = {k: v for k, v in vars(self._args).items() if not callable(v)}
        if self.share_dir:
            args["core_share_file"] = os.path.join(self.share_dir, f"replica-{r.index}.cores")
        payload = {"args": args, "index": r.index, "cores": r.cores, "port": r.port, "parent_pid": os.getpid()}
        r.proc.stdin.write(json.dumps(payload).encode())
        r.proc.stdin.close()

    def signal_all(self, sig: int) -> None:
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    r.proc.send_signal(sig)

    def wait_exited(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for r in self.replicas:
            if r.proc is None:
                continue
            try:
                r.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def kill(self) -> None:
        self.signal_all(signal.SIGKILL)
        self.wait_exited(10.0)

    def remove_files(self) -> None:
        if self.share_dir:
            shutil.rmtree(self.share_dir, ignore_errors=True)

    # -- routing ---------------------------------------------------------------------------------------------------
    def available(self, exclude: set[int]) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and not r.exited and r.index not in exclude]

    def pick(self, text: str | None, exclude: set[int]) -> Replica | None:
        avail = self.available(exclude)
        if not avail:
            return None
        return self.replicas[self.router.choose(text_chain(text), {r.index: r.in_flight for r in avail})]

    def mark_exited(self, r: Replica, why: str) -> None:
        """Replica ``r``'s process is gone: out of rotation, and started again (it rejoins when its /health answers)
        unless it died ``MAX_RESTARTS`` times within ``RESTART_WINDOW_S`` or the set is stopping."""
        if r.exited:
            return
        r.exited, r.healthy = True, False
        if self.stopping:
            return
        now = time.monotonic()
        recent = [t for t in r.restarts if now - t < RESTART_WINDOW_S]
        if len(recent) < MAX_RESTARTS:
            logger.critical("replica %d (pid %s) died (%s): starting it again (restart %d)", r.index,
                            r.proc.pid if r.proc else None, why, len(r.restarts) + 1)
            r.restarts.append(now)
            self.router.forget(r.index)  # its prefix cache starts empty
            self._spawn(r)
            r.exited = False
            return
        logger.critical("replica %d (pid %s) is out of rotation for good: %s (it died %d times in %.0f s)", r.index,
                        r.proc.pid if r.proc else None, why, len(recent) + 1, RESTART_WINDOW_S)
        if all(x.exited for x in self.replicas):
            self.failed = f"every replica has exited (the last: {why})"

    async def monitor(self, client: httpx.AsyncClient, period_s: float = 0.5) -> None:
        """Polls the processes and their /health until cancelled; a replica that stops answering 200 leaves the
        rotation until it answers again, one whose process exited is restarted (``mark_exited``)."""
        while True:
            for r in self.replicas:
                if r.exited:
                    continue
                code = r.proc.poll()
                if code is not None:
                    self.mark_exited(r, f"its process exited with code {code}")
                    continue
                try:
                    resp = await client.get(r.url + "/health", timeout=2.0)
                    r.healthy = resp.status_code == 200
                except httpx.HTTPError:
                    r.healthy = False
            await asyncio.sleep(period_s)

    def describe(self) -> list[dict]:
        return [{"engine": r.index, "url": r.url, "cores": r.cores, "pid": r.proc.pid if r.proc else None,
                 "healthy": r.healthy and not r.exited, "exited": r.exited, "in_flight": r.in_flight,
                 "routed": r.routed, "restarts": len(r.restarts)} for r in self.replicas]


def _pin(cores: list[int]):
    """A child's pre-exec step: its CPU affinity (Linux; elsewhere the replicas share the cores)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, cores)


def replica_endpoint(endpoint: str, index: int) -> str:
    """Replica ``index``'s KV-events endpoint: a TCP port moved up by the index (5557, 5558, ...), another kind of
    address suffixed."""
    if index == 0:
        return endpoint
    head, _, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and port.isdigit():
        return f"{head}:{int(port) + index}"
    return f"{endpoint}-{index}"


def _forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}


def _response_headers(resp: httpx.Response, r: Replica) -> dict[str, str]:
    """The replica's headers, and which replica answered (``x-pagedllm-engine``: its index)."""
    out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
    out[ENGINE_HEADER] = str(r.index)
    return out


def build_balancer_app(replicas: ReplicaSet, api_key: str | None, max_body_bytes: int,
                       metrics_require_auth: bool = False) -> FastAPI:
    # no timeout on reading a replica's answer (a long generation streams for minutes); connecting is quick or dead
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(replicas.monitor(client))
        yield
        task.cancel()
        await client.aclose()

    app = FastAPI(title="pagedllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    install_error_handlers(app)
    public = frozenset({"/health"} if metrics_require_auth else {"/health", "/metrics"})
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, public_paths=public)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(DrainingMiddleware, state=app.state)

    @app.get("/health", response_model=None)
    async def health():
        if app.state.draining:
            return error_json(503, "the server is stopping: finishing the requests in flight, taking no new ones")
        detail = {"status": "ok", "data_parallel_size": len(replicas.replicas), "policy": replicas.policy,
                  "replicas": replicas.describe()}
        if not replicas.available(set()):
            return error_json(503, f"no replica is available: {json.dumps(detail['replicas'])}")
        return detail

    @app.get("/metrics", response_model=None)
    async def metrics(request: Request):
        texts = {}
        for r in replicas.replicas:
            if r.exited:
                continue
            with contextlib.suppress(httpx.HTTPError):
                resp = await client.get(r.url + "/metrics", headers=_forward_headers(request), timeout=5.0)
                if resp.status_code == 200:
                    texts[str(r.index)] = resp.text
        return Response(merge_expositions(texts, "engine"), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    async def forward(path: str, request: Request):
        body = await request.body()
        text = routing_text(body) if request.method == "POST" else None
        target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        headers = _forward_headers(request)
        tried: set[int] = set()
        while True:
            r = replicas.pick(text, tried)
            if r is None:
                return error_json(503, "no replica is available to take the request", path=request.url.path)
            r.in_flight += 1
            r.routed += 1
            try:
                resp = await client.send(client.build_request(request.method, r.url + target, headers=headers,
                                                              content=body), stream=True)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # never reached it: another replica may
                r.in_flight -= 1
                tried.add(r.index)
                r.healthy = False
                logger.warning("replica %d did not take a request (%s): trying another", r.index, e)
            except httpx.HTTPError as e:  # it took the request and failed before answering
                r.in_flight -= 1
                return _replica_failed(r, e, request.url.path)
        if "text/event-stream" not in resp.headers.get("content-type", ""):
            try:
                content = await resp.aread()
            except httpx.HTTPError as e:
                return _replica_failed(r, e, request.url.path)
            finally:
                await resp.aclose()
                r.in_flight -= 1
            return Response(content, status_code=resp.status_code, headers=_response_headers(resp, r))

        async def relay():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:  # the replica went away mid-stream: the client gets an error event
                logger.warning("replica %d failed mid-stream: %s", r.index, e)
                err = {"error": {"message": f"replica {r.index} failed while streaming: {e}",
                                 "type": "internal_server_error", "param": None, "code": 502}}
                yield f"data: {json.dumps(err)}\n\n".encode()
            finally:
                await resp.aclose()
                r.in_flight -= 1

        return StreamingResponse(relay(), status_code=resp.status_code, headers=_response_headers(resp, r))

    return app


def _replica_failed(r: Replica, e: Exception, path: str):
    logger.warning("replica %d failed a request: %s", r.index, e)
    return error_json(502, f"replica {r.index} failed before answering: {type(e).__name__}: {e}", path=path)


def run_data_parallel(args) -> int:
    """`pagedllm serve --data-parallel-size N` (N > 1): start the replicas, then serve the balancer until a signal
    (drain) or until every replica has exited (an error)."""
    import uvicorn  # noqa: PLC0415 -- heavy, only a server needs it

    n = args.data_parallel_size
    if getattr(args, "tensor_parallel_size", 1) not in (None, 1):
        raise ValueError("--data-parallel-size with --tensor-parallel-size is not supported: give one of them")
    replicas = ReplicaSet(args, n, args.data_parallel_policy)
    replicas.start()
    app = build_balancer_app(replicas, args.api_key, args.max_request_body_bytes, args.metrics_require_auth)
    drain_s = args.drain_timeout_s

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            self._captured_signals.clear()
            if app.state.draining:  # a second signal: the replicas stop now, and so does this
                replicas.signal_all(signal.SIGTERM)
                self.should_exit = True
                return
            app.state.draining = replicas.stopping = True
            logger.info("stopping: the replicas' requests in flight have %.0f s to finish", drain_s)
            replicas.signal_all(signal.SIGTERM)  # each drains (its /health 503) and exits
            threading.Thread(target=self._stop_when_replicas_exit, daemon=True).start()

        def _stop_when_replicas_exit(self) -> None:
            replicas.wait_exited(drain_s + 15.0)
            self.should_exit = True

    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                    timeout_graceful_shutdown=drain_s + 5))

    def watch_failed() -> None:  # no replica left: stop serving
        while not server.should_exit:
            if replicas.failed:
                logger.critical("stopping the server: %s", replicas.failed)
                server.should_exit = True
                return
            time.sleep(0.2)

    threading.Thread(target=watch_failed, daemon=True).start()
    logger.info("serving %d replicas on http://%s:%d", n, args.host, args.port)
    try:
        server.run()
    finally:
        if not replicas.wait_exited(0.0):
            replicas.signal_all(signal.SIGTERM)
            if not replicas.wait_exited(drain_s + 15.0):
                replicas.kill()
        replicas.remove_files()
    if replicas.failed:
        print(f"error: data parallelism failed: {replicas.failed}", file=sys.stderr)
        return 1
    logger.info("server stopped")
    return 0
