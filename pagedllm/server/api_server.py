"""OpenAI-compatible HTTP server (FastAPI) over the AsyncLLM continuous-batching loop."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError, RequestFailedError
from pagedllm.errors import EngineOverloadedError
from pagedllm.sampling_params import RANGES
from pagedllm.server import openapi
from pagedllm.server.degradation import STATE_CODE, CircuitBreaker, FaultInjection
from pagedllm.outputs import RequestOutput
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagedllm.server.tools import (TOOL_CALL_PARSERS, extract_tool_calls, plan_tools, template_messages,
                                   visible_content)

logger = logging.getLogger("pagedllm.server")

MAX_BODY_BYTES = 8 * 1024 * 1024
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.err_type = err_type or _ERROR_TYPES.get(status, "invalid_request_error")


def error_json(status: int, message: str, param: str | None = None, err_type: str | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": err_type or _ERROR_TYPES.get(status, "invalid_request_error"),
                           "param": param, "code": status}},
    )


class BodyLimitMiddleware:
    """Refuses bodies over the limit before anything parses them (Content-Length, or counted while streaming)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await error_json(413, f"request body is larger than {self.max_bytes} bytes")(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise APIError(413, f"request body is larger than {self.max_bytes} bytes")
            return msg

        return await self.app(scope, limited_receive, send)


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on every route except the public ones (/health, and /metrics unless
    --metrics-require-auth); the key is compared in constant time. Plain ASGI, so that disconnect detection
    downstream still sees the real receive channel."""

    def __init__(self, app, api_key: str, public_paths: frozenset[str] = frozenset({"/health"})) -> None:
        self.app, self.key, self.public = app, api_key.encode(), public_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.public:
            header = dict(scope.get("headers", [])).get(b"authorization", b"")
            token = header[7:] if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                resp = error_json(401, "Invalid or missing API key")
                resp.headers["WWW-Authenticate"] = "Bearer"
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


class ClientGone(Exception):
    """The client closed the connection before the response started."""


def _stream_line(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _stream_error(e: Exception) -> str:
    status = e.status if isinstance(e, EngineOverloadedError) else 500
    kind = "overloaded" if isinstance(e, EngineOverloadedError) else "internal_server_error"
    return _stream_line({"error": {"message": str(e), "type": kind, "param": None, "code": status}})


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_names: list[str], fallback: AsyncLLM | None = None,
                 fallback_name: str | None = None, breaker: CircuitBreaker | None = None,
                 request_timeout_s: float | None = None, faults: FaultInjection | None = None,
                 auto_tools: bool = False) -> None:
        self.engine = engine
        self.auto_tools = auto_tools  # --enable-auto-tool-choice with a --tool-call-parser
        self.model_names = model_names
        self.tokenizer = engine.tokenizer
        self.fallback, self.fallback_name = fallback, fallback_name
        self.breaker = breaker
        self.request_timeout_s = request_timeout_s
        self.faults = faults

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.model_names:
            return self.model_names[0]
        if self.fallback is not None and model == self.fallback_name:
            return model
        raise APIError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")

    # ------------------------------------------------------------------ shared
    @staticmethod
    async def _queue(engine: AsyncLLM, prompts, params, req) -> list[AsyncIterator]:
        """Queue one request per prompt; a bad prompt aborts those already queued and raises."""
        gens = []
        try:
            for text, ids in prompts:
                gens.append(engine.generate(text, ids, params, priority=req.priority,
                                            max_queue_delay_ms=req.max_queue_delay_ms))
        except BaseException:
            for g in gens:
                await g.aclose()
            raise
        return gens

    async def _start(self, encode, params, req, model: str, raw: Request) -> tuple[list[AsyncIterator], str]:
        """Queue the request's prompts on the primary, or on the fallback model when the primary's circuit is
        open, when the primary fails before its first token, or when it does not start within the request
        timeout. ``encode(engine)`` tokenizes the prompts for an engine. Returns the streams and who serves.
        A stream's first output is awaited before the response starts, so that a request the engine drops while
        queued (overload) gets its HTTP status (503 + Retry-After) rather than an error inside a 200 stream."""
        degradable = self.fallback is not None or self.request_timeout_s is not None or self.faults is not None
        if model != self.fallback_name and (self.breaker is None or self.breaker.allow()):
            prompts = encode(self.engine)
            gens = await self._queue(self.engine, prompts, params, req)
            if not degradable:
                if req.stream:
                    gens = await self._first_outputs(gens, prompts, raw)
                return gens, self.model_names[0]
            try:
                gens = await self._first_outputs(gens, prompts, raw)
            except (asyncio.TimeoutError, RequestFailedError, EngineDeadError) as e:
                if self.breaker is not None:
                    self.breaker.record_failure()
                if self.fallback is None:
                    if isinstance(e, asyncio.TimeoutError):
                        raise EngineOverloadedError(
                            f"the request did not start within {self.request_timeout_s:g} s", 503) from None
                    raise
                logger.warning("primary failed (%s); serving the request with the fallback model",
                               type(e).__name__ if isinstance(e, asyncio.TimeoutError) else e)
            else:
                if self.breaker is not None:
                    self.breaker.record_success()
                return gens, self.model_names[0]
        elif self.fallback is None:
            raise EngineOverloadedError("the primary model's circuit breaker is open", 503, retry_after=1.0)
        gens = await self._queue(self.fallback, encode(self.fallback), params, req)
        if req.stream:
            gens = await self._first_outputs(gens, [(None, None)] * len(gens), raw, primary=False)
        return gens, self.fallback_name

    async def _first_outputs(self, gens: list[AsyncIterator], prompts, raw: Request,
                             primary: bool = True) -> list[AsyncIterator]:
        """Wait for every stream's first output (on the primary: up to the request timeout, and fault injection
        acts here). A client that goes away meanwhile aborts the streams (ClientGone)."""

        async def first(g, text):
            action = self.faults.action(text) if self.faults is not None and primary else None
            if action == "fail":
                raise RequestFailedError("injected fault: the primary failed")
            if action == "stall":
                await asyncio.Event().wait()  # never set: the primary stalls
            return await g.__anext__()

        firsts = await _unless_gone(asyncio.wait_for(
            asyncio.gather(*(first(g, t) for g, (t, _) in zip(gens, prompts))),
            timeout=self.request_timeout_s if primary else None), gens, raw)
        return [_prepend(f, g) for f, g in zip(firsts, gens)]

    @staticmethod
    async def _final_outputs(gens: list[AsyncIterator], raw: Request) -> list[RequestOutput]:
        """Consume every generator to its end (a client that goes away aborts them all: ClientGone)."""

        async def last(g):
            out = None
            async for out in g:
                pass
            return out

        return await _unless_gone(asyncio.gather(*(last(g) for g in gens)), gens, raw)

    @staticmethod
    async def _merged(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Interleave the outputs of several generators as they come: (prompt index, output)."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i, g):
            try:
                async for out in g:
                    await queue.put((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, e))
            finally:
                await queue.put((i, done))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        remaining = len(gens)
        try:
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await _close_all(gens)

    @staticmethod
    def _usage(finals: list[RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in finals)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ------------------------------------------------------------------ /v1/completions
    def _completion_logprobs(self, lps, text_offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            tokens.append(lp.decoded_token)
            token_lps.append(lp.logprob)
            tops.append({t.decoded_token: t.logprob for t in lp.top} or None)
            offsets.append(text_offset)
            text_offset += len(lp.decoded_token)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def completions(self, req: CompletionRequest, raw: Request):
        model = self.check_model(req.model)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo together with logprobs (prompt logprobs) is not supported", "echo")
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(t, int) for t in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError(400, "prompt must not be empty", "prompt")
        self._refuse_unsupported(req)
        encoded = [self.engine.encode_prompt(x) for x in prompts]
        params = req.to_sampling_params(req.max_tokens, req.logprobs, req.structured())
        gens, model = await self._start(
            lambda eng: encoded if eng is self.engine else [eng.encode_prompt(x) for x in prompts], params, req, model,
            raw)
        served = {"x-pagedllm-served-by": model}
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        n = req.n

        def prompt_text(i: int) -> str:
            text, ids = encoded[i]
            return text if text is not None else self.tokenizer.decode(ids)

        if not req.stream:
            finals = await self._final_outputs(gens, raw)
            choices = []
            for i, o in enumerate(finals):
                for c in o.outputs:
                    text = (prompt_text(i) if req.echo else "") + c.text
                    choices.append({
                        "index": i * n + c.index, "text": text, "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                        "logprobs": self._completion_logprobs(c.logprobs, 0) if c.logprobs is not None else None,
                    })
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": choices, "usage": self._usage(finals)}, headers=served)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def stream():
            sent_text: dict[int, int] = {}
            sent_lps: dict[int, int] = {}
            finals: dict[int, RequestOutput] = {}
            try:
                async for i, o in self._merged(gens):
                    for c in o.outputs:
                        idx = i * n + c.index
                        start = sent_text.get(idx)
                        delta = c.text[start or 0:]
                        if start is None and req.echo:
                            delta = prompt_text(i) + delta
                        lps = None
                        if c.logprobs is not None:
                            k = sent_lps.get(idx, 0)
                            lps = self._completion_logprobs(c.logprobs[k:], start or 0)
                            sent_lps[idx] = len(c.logprobs)
                        if not delta and c.finish_reason is None and not (lps and lps["tokens"]):
                            continue
                        sent_text[idx] = len(c.text)
                        yield _stream_line({"id": rid, "object": "text_completion", "created": created,
                                            "model": model, "choices": [{
                                                "index": idx, "text": delta, "logprobs": lps,
                                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
                    if o.finished:
                        finals[i] = o
                if include_usage:
                    yield _stream_line({"id": rid, "object": "text_completion", "created": created, "model": model,
                                        "choices": [], "usage": self._usage(list(finals.values()))})
            except (RequestFailedError, EngineDeadError, EngineOverloadedError) as e:
                yield _stream_error(e)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers=served)

    # ------------------------------------------------------------------ /v1/chat/completions
    def _chat_logprobs(self, lps) -> dict:
        def entry(tok: str, lp: float) -> dict:
            return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

        return {"content": [
            {**entry(lp.decoded_token, lp.logprob), "top_logprobs": [entry(t.decoded_token, t.logprob) for t in lp.top]}
            for lp in lps
        ]}

    @staticmethod
    def _refuse_unsupported(req) -> None:
        bad = req.unsupported_fields()
        if bad:
            raise APIError(400, f"unsupported field(s) {bad}: pagedllm does not implement "
                                f"{'it' if len(bad) == 1 else 'them'}", bad[0])

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        model = self.check_model(req.model)
        self._refuse_unsupported(req)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.auto_tools)
        structured = req.structured()
        if plan.structured is not None:
            if structured is not None:
                raise APIError(400, f"tool_choice {plan.mode!r} constrains the output itself: it cannot be combined "
                                    "with response_format or guided decoding", "tool_choice")
            structured = plan.structured
        tools = req.tools if plan.mode != "none" else None
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):  # content parts: only text is supported
                parts = []
                for part in content:
                    if part.get("type") != "text":
                        raise APIError(400, f"message content part type {part.get('type')!r} is not supported",
                                       "messages")
                    parts.append(part.get("text", ""))
                content = "".join(parts)
            msg = {"role": m.role, "content": content or ""}
            for key in ("tool_calls", "tool_call_id", "name"):
                if (m.model_extra or {}).get(key) is not None:
                    msg[key] = m.model_extra[key]
            messages.append(msg)
        messages = template_messages(messages)
        encoded = [self.engine.encode_chat(messages, tools)]  # a template error is a 400 before anything is queued
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = req.to_sampling_params(max_tokens, logprobs, structured)
        gens, model = await self._start(
            lambda eng: encoded if eng is self.engine else [eng.encode_chat(messages, tools)], params, req, model, raw)
        served = {"x-pagedllm-served-by": model}
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        if not req.stream:
            finals = await self._final_outputs(gens, raw)
            final = finals[0]
            choices = []
            for c in final.outputs:
                content, calls = extract_tool_calls(plan, c.text)
                message = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = calls
                choices.append({
                    "index": c.index, "message": message,
                    "logprobs": self._chat_logprobs(c.logprobs) if c.logprobs is not None else None,
                    "finish_reason": "tool_calls" if calls else c.finish_reason, "stop_reason": c.stop_reason,
                })
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                                 "choices": choices, "usage": self._usage([final])}, headers=served)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices, usage=None):
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return _stream_line(body)

        async def stream():
            sent_text: dict[int, int] = {}
            sent_lps: dict[int, int] = {}
            final = None
            try:
                for i in range(req.n):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                async for _, o in self._merged(gens):
                    for c in o.outputs:
                        start = sent_text.get(c.index, 0)
                        calls = []  # content streams as it comes, except what may be (or is) a tool call
                        if plan.mode == "none":
                            shown = c.text
                        elif c.finish_reason is None:
                            shown = visible_content(plan, c.text)
                        else:
                            _, calls = extract_tool_calls(plan, c.text)
                            shown = visible_content(plan, c.text) if calls else c.text
                        delta = shown[start:]
                        lps = None
                        if c.logprobs is not None:
                            k = sent_lps.get(c.index, 0)
                            lps = self._chat_logprobs(c.logprobs[k:])
                            sent_lps[c.index] = len(c.logprobs)
                        if not delta and c.finish_reason is None and not (lps and lps["content"]):
                            continue
                        sent_text[c.index] = len(shown)
                        d = {"content": delta} if delta else {}
                        if calls:
                            d["tool_calls"] = [{"index": j, **call} for j, call in enumerate(calls)]
                        finish = "tool_calls" if calls else c.finish_reason
                        yield chunk([{"index": c.index, "delta": d, "logprobs": lps, "finish_reason": finish}])
                    if o.finished:
                        final = o
                if include_usage and final is not None:
                    yield chunk([], self._usage([final]))
            except (RequestFailedError, EngineDeadError, EngineOverloadedError) as e:
                yield _stream_error(e)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers=served)


async def _unless_gone(awaitable, gens: list[AsyncIterator], raw: Request):
    """Await while watching the connection: if the client goes away (or anything fails), cancel, close the streams
    (which aborts their requests) and raise (ClientGone: the app answers 499, which nobody reads)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await raw.is_disconnected():
                raise ClientGone()
    except BaseException:
        task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 - its own cancellation or failure; the one being raised wins
            pass
        await _close_all(gens)
        raise


async def _close_all(gens: list[AsyncIterator]) -> None:
    """Close streams (aborting their requests). One that a just-cancelled task is still inside closes itself when
    that task unwinds; closing it here too would raise "asynchronous generator is already running"."""
    for g in gens:
        if not getattr(g, "ag_running", False):
            await g.aclose()


async def _prepend(first, gen: AsyncIterator) -> AsyncIterator:
    """A stream whose first output was already read."""
    try:
        yield first
        if not first.finished:
            async for x in gen:
                yield x
    finally:
        await gen.aclose()


def build_app(engine: AsyncLLM, model_names: list[str], api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, metrics=None, fallback: AsyncLLM | None = None,
              fallback_name: str | None = None, breaker: CircuitBreaker | None = None,
              request_timeout_s: float | None = None, faults: FaultInjection | None = None,
              auto_tools: bool = False, metrics_require_auth: bool = False) -> FastAPI:
    serving = OpenAIServing(engine, model_names, fallback, fallback_name, breaker, request_timeout_s, faults,
                            auto_tools)

    @asynccontextmanager
    async def lifespan(app):
        yield
        logger.info("shutting down: aborting unfinished requests")
        engine.shutdown()
        if fallback is not None:
            fallback.shutdown()

    app = FastAPI(title="pagedllm", version=pagedllm.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.serving = serving
    public = frozenset({"/health"} if metrics_require_auth else {"/health", "/metrics"})

    def custom_openapi():
        if app.openapi_schema is None:
            app.openapi_schema = openapi.finalize(
                get_openapi(title=app.title, version=app.version, routes=app.routes), RANGES,
                public if api_key else None)
        return app.openapi_schema

    app.openapi = custom_openapi

    @app.exception_handler(RequestValidationError)
    async def _validation(_, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return error_json(400, f"Invalid JSON in request body: {first.get('msg')}")
        return error_json(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param)

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error_json(exc.status, exc.message, exc.param, exc.err_type)

    @app.exception_handler(ValueError)
    async def _value_error(_, exc: ValueError):
        return error_json(400, str(exc))

    @app.exception_handler(RequestFailedError)
    async def _failed(_, exc: RequestFailedError):
        return error_json(500, f"the engine failed on this request: {exc}")

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(_, exc: EngineOverloadedError):
        resp = error_json(exc.status, str(exc), None, "overloaded")
        resp.headers["Retry-After"] = str(max(1, round(exc.retry_after or 1.0)))
        return resp

    @app.exception_handler(ClientGone)
    async def _gone(_, exc: ClientGone):
        return Response(status_code=499)  # nobody reads this

    @app.exception_handler(EngineDeadError)
    async def _dead(_, exc: EngineDeadError):
        return error_json(503, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        return error_json(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        logger.exception("unhandled error")
        return error_json(500, f"internal error: {type(exc).__name__}: {exc}")

    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, public_paths=public)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)

    @app.get("/health", response_model=None, responses={200: {"model": openapi.HealthResponse},
                                                         **openapi.errors(503)})
    async def health():
        if not engine.is_alive:
            return error_json(503, "engine loop is not running")
        detail: dict = {"status": "ok", "runtime": engine.runtime}
        if breaker is not None:
            detail["circuit"] = breaker.detail()
        if fallback is not None:
            detail["fallback"] = {"model": fallback_name, "alive": fallback.is_alive}
        return detail

    @app.get("/version", response_model=None, responses={200: {"model": openapi.VersionResponse},
                                                          **openapi.errors(401)})
    async def version():
        return {"version": pagedllm.__version__, "runtime": engine.runtime}

    @app.get("/v1/models", response_model=None, responses={200: {"model": openapi.ModelList},
                                                            **openapi.errors(401)})
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(time.time()), "owned_by": "pagedllm",
             "root": engine.engine.model_path, "max_model_len": engine.max_model_len,
             "vocab_size": engine.engine.core.vocab_size}
            for name in model_names]}

    @app.post("/v1/completions", response_model=None,
              responses={**openapi.GENERATE_RESPONSES, 200: {**openapi.GENERATE_RESPONSES[200],
                                                             "model": openapi.CompletionResponse}})
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions", response_model=None,
              responses={**openapi.GENERATE_RESPONSES, 200: {**openapi.GENERATE_RESPONSES[200],
                                                             "model": openapi.ChatCompletionResponse}})
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @app.post("/tokenize", response_model=None,
              responses={200: {"model": openapi.TokenizeResponse}, **openapi.SIMPLE_RESPONSES})
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            _, ids = engine.encode_chat([m.model_dump(include={"role", "content"}) for m in req.messages])
        else:
            ids = engine.encode_text(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize", response_model=None,
              responses={200: {"model": openapi.DetokenizeResponse}, **openapi.SIMPLE_RESPONSES})
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        vocab = engine.engine.core.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range [0, {vocab})", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.get("/debug/kv", response_model=None, responses={200: {"model": openapi.KVCacheState},
                                                           **openapi.errors(401)})
    async def debug_kv():
        """The KV block pool now (leak checks: after all requests end, every block is free)."""
        return engine.kv_state()

    @app.get("/metrics", response_model=None, responses={
        200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **openapi.errors(401, 404)})
    async def metrics_endpoint():
        if metrics is None:
            return error_json(404, "metrics are disabled")
        if breaker is not None:
            metrics.set_circuit_state(STATE_CODE[breaker.state])
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


# ---------------------------------------------------------------------- start-up
def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="name clients use (default: the model's name)")
    g.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"),
                   help="require this bearer key on every route but /health (and /metrics, see below)")
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
                        "Hermes-style templates)")
    g.add_argument("--fault-injection", default=os.environ.get("PAGEDLLM_FAULT_INJECTION"),
                   help='tests only: \'{"fail_marker": "...", "stall_marker": "..."}\' makes the primary fail or '
                        "stall on prompts containing the marker")


def default_served_name(model: str | None) -> str:
    if model is None:
        from pagedllm.config import DEFAULT_MODEL_FILE

        return DEFAULT_MODEL_FILE.split(".")[0]
    return model


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedllm.engine.arg_utils import config_from_args
    from pagedllm.metrics.prometheus import PrometheusStatLogger

    logging.getLogger("pagedllm").setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)  # a flag the engine cannot honour stops here, with its message
    faults = FaultInjection.parse(args.fault_injection)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
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
    runner = engine.engine.core.runner
    metrics = PrometheusStatLogger(name, runner.kv_cache_bytes, runner.num_blocks * runner.block_size,
                                   runner.bytes_per_block)
    engine.stat_loggers.append(metrics)
    fallback = fallback_name = breaker = None
    if args.fallback_model:
        import dataclasses

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
                    auto_tools=args.enable_auto_tool_choice, metrics_require_auth=args.metrics_require_auth)
    drain_s = args.drain_timeout_s

    class _Server(uvicorn.Server):
        drain_timer: threading.Timer | None = None

        def handle_exit(self, sig, frame):  # graceful stop, then a normal exit (no re-raised signal)
            super().handle_exit(sig, frame)
            self._captured_signals.clear()
            if self.drain_timer is None:  # requests still running when the drain time is up are ended
                logger.info("stopping: requests in flight have %.0f s to finish", drain_s)
                self.drain_timer = threading.Timer(drain_s, _end_in_flight)
                self.drain_timer.daemon = True
                self.drain_timer.start()

    def _end_in_flight() -> None:
        logger.warning("drain timeout (%.0f s): ending the requests still in flight", drain_s)
        engine.shutdown()
        if fallback is not None:
            fallback.shutdown()

    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                    timeout_graceful_shutdown=drain_s + 5))
    tp_failures: list[str] = []
    if runner.tp is not None:  # a tensor-parallel rank that dies takes the server down (the watchdog calls this)
        def _tp_failed(message: str) -> None:
            logger.critical("stopping the server: %s", message)
            tp_failures.append(message)
            server.should_exit = True

        runner.tp.add_failure_callback(_tp_failed)
    logger.info("serving %s on http://%s:%d", name, args.host, args.port)
    server.run()
    if server.drain_timer is not None:
        server.drain_timer.cancel()
    engine.shutdown()
    if fallback is not None:
        fallback.shutdown()
    if tp_failures:
        print(f"error: tensor parallelism failed: {tp_failures[0]}", file=sys.stderr)
        return 1
    logger.info("server stopped")
    return 0
