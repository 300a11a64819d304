"""The OpenAI-compatible HTTP app (FastAPI) over AsyncLLM engines, with Anthropic's Messages API beside it: its
routes, middleware, error handlers, lifespan and OpenAPI schema."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response

from pagedllm import __version__
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.sampling_params import RANGES
from pagedllm.server import openapi
from pagedllm.server.degradation import STATE_CODE, CircuitBreaker, FallbackRouter, FaultInjection
from pagedllm.server.errors import APIError, error_json, install_error_handlers
from pagedllm.server.middleware import MAX_BODY_BYTES, ApiKeyMiddleware, BodyLimitMiddleware, DrainingMiddleware
from pagedllm.server.protocol import (AnthropicCountTokensRequest, AnthropicMessagesRequest, ChatCompletionRequest,
                                      CompletionRequest, DetokenizeRequest, EmbeddingRequest, RerankRequest,
                                      ResponsesRequest, ScoreRequest, TokenizeRequest)
from pagedllm.server.serving_chat import OpenAIServingChat
from pagedllm.server.serving_completion import OpenAIServingCompletion
from pagedllm.server.serving_embedding import OpenAIServingEmbedding
from pagedllm.server.serving_messages import AnthropicServingMessages
from pagedllm.server.serving_responses import OpenAIServingResponses

logger = logging.getLogger("pagedllm.server")

VERSION = __version__


def build_app(engine: AsyncLLM, model_names: list[str], api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, metrics: PrometheusStatLogger | None = None,
              fallback: AsyncLLM | None = None, fallback_name: str | None = None,
              breaker: CircuitBreaker | None = None, request_timeout_s: float | None = None,
              faults: FaultInjection | None = None, auto_tools: bool = False,
              metrics_require_auth: bool = False, reasoning_parser: str | None = None,
              structured_in_reasoning: bool = False, tool_call_parser: str | None = None) -> FastAPI:
    router = FallbackRouter(engine, model_names[0], fallback, fallback_name, breaker, request_timeout_s, faults)
    serving_completion = OpenAIServingCompletion(engine, model_names, router)
    serving_chat = OpenAIServingChat(engine, model_names, router, auto_tools, reasoning_parser,
                                     structured_in_reasoning, tool_call_parser)
    serving_messages = AnthropicServingMessages(serving_chat)
    serving_embedding = OpenAIServingEmbedding(engine, model_names, router)
    serving_responses = OpenAIServingResponses(serving_chat)

    @asynccontextmanager
    async def lifespan(app):
        yield
        logger.info("shutting down: aborting unfinished requests")
        engine.shutdown()
        if fallback is not None:
            fallback.shutdown()

    app = FastAPI(title="pagedllm", version=VERSION, lifespan=lifespan)
    app.state.engine = engine
    # set on a graceful stop: /health answers 503 and new work is refused (routers send it elsewhere) while the
    # requests in flight finish; then the server stops listening
    app.state.draining = False
    public = frozenset({"/health"} if metrics_require_auth else {"/health", "/metrics"})

    def custom_openapi():
        if app.openapi_schema is None:
            app.openapi_schema = openapi.finalize(
                get_openapi(title=app.title, version=app.version, routes=app.routes), RANGES,
                public if api_key else None)
        return app.openapi_schema

    app.openapi = custom_openapi
    install_error_handlers(app)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, public_paths=public)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(DrainingMiddleware, state=app.state)

    @app.get("/health", response_model=None, responses={200: {"model": openapi.HealthResponse},
                                                         **openapi.errors(503)})
    async def health():
        if not engine.is_alive:
            return error_json(503, "engine loop is not running")
        if app.state.draining:
            return error_json(503, "the server is stopping: finishing the requests in flight, taking no new ones")
        detail: dict = {"status": "ok", "runtime": engine.runtime}
        if breaker is not None:
            detail["circuit"] = breaker.detail()
        if fallback is not None:
            detail["fallback"] = {"model": fallback_name, "alive": fallback.is_alive}
        return detail

    @app.get("/version", response_model=None, responses={200: {"model": openapi.VersionResponse},
                                                          **openapi.errors(401)})
    async def version():
        return {"version": VERSION, "runtime": engine.runtime}

    @app.get("/v1/models", response_model=None, responses={200: {"model": openapi.ModelList},
                                                            **openapi.errors(401)})
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(time.time()), "owned_by": "pagedllm",
             "root": engine.model_path, "max_model_len": engine.max_model_len,
             "vocab_size": engine.vocab_size}
            for name in model_names]}

    @app.post("/v1/completions", response_model=None,
              responses={**openapi.GENERATE_RESPONSES, 200: {**openapi.GENERATE_RESPONSES[200],
                                                             "model": openapi.CompletionResponse}})
    async def completions(req: CompletionRequest, raw: Request):
        return await serving_completion.create_completion(req, raw)

    @app.post("/v1/chat/completions", response_model=None,
              responses={**openapi.GENERATE_RESPONSES, 200: {**openapi.GENERATE_RESPONSES[200],
                                                             "model": openapi.ChatCompletionResponse}})
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await serving_chat.create_chat_completion(req, raw)

    @app.post("/v1/responses", response_model=None, responses=openapi.RESPONSES_RESPONSES)
    async def responses(req: ResponsesRequest, raw: Request):
        """OpenAI's Responses API, stateless (`store: true` and `previous_response_id` are refused)."""
        return await serving_responses.create_response(req, raw)

    @app.post("/v1/embeddings", response_model=None, responses=openapi.EMBEDDING_RESPONSES)
    async def embeddings(req: EmbeddingRequest, raw: Request):
        """One vector per input: the final hidden states pooled (`pooling`: last token or mean), L2-normalised."""
        return await serving_embedding.create_embedding(req, raw)

    async def rerank(req: RerankRequest, raw: Request):
        """The documents by relevance to the query (Jina's / Cohere's shape): the cosine of an embedding model's
        vectors, the query's and each document's under the model's query / document prompts where it has them."""
        return await serving_embedding.rerank(req, raw)

    async def score(req: ScoreRequest, raw: Request):
        """vLLM's score: the cosine of an embedding model's vectors of text_1 and each of text_2."""
        return await serving_embedding.score(req, raw)

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.post(path, response_model=None, responses=openapi.SCORE_RESPONSES)(rerank)
    for path in ("/score", "/v1/score"):
        app.post(path, response_model=None, responses=openapi.SCORE_RESPONSES)(score)

    @app.post("/v1/messages", response_model=None, responses=openapi.MESSAGES_RESPONSES)
    async def messages(req: AnthropicMessagesRequest, raw: Request):
        """Anthropic's Messages API (errors in Anthropic's shape; `x-api-key` is accepted as the key)."""
        return await serving_messages.create_message(req, raw)

    @app.post("/v1/messages/count_tokens", response_model=None, responses=openapi.COUNT_TOKENS_RESPONSES)
    async def count_tokens(req: AnthropicCountTokensRequest):
        return await serving_messages.count_tokens(req)

    @app.post("/tokenize", response_model=None,
              responses={200: {"model": openapi.TokenizeResponse}, **openapi.SIMPLE_RESPONSES})
    async def tokenize(req: TokenizeRequest):
        serving_completion.check_model(req.model)
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
        serving_completion.check_model(req.model)
        vocab = engine.vocab_size
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
