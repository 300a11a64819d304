"""What the server's OpenAPI schema (`/openapi.json`) says about its responses and limits.

FastAPI derives request bodies from the pydantic models in ``protocol``; this module adds what it cannot see: the
response bodies (OpenAI's shapes, Anthropic's on ``/v1/messages``; JSON or an SSE stream), the error statuses every
route can answer with (OpenAI's error object, Anthropic's on its routes; 400 where FastAPI would document 422), the
numeric ranges the engine enforces (``sampling_params.RANGES``), that unknown request fields are refused, and the
key's security schemes (bearer; also ``x-api-key`` on the Anthropic routes).
A fuzzer (`python -m tools.reliability`) checks every response against this schema.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from pagedllm.server.errors import anthropic_route
from pagedllm.server.protocol import ANTHROPIC_HINT_FIELDS, HINT_FIELDS, RESPONSES_HINT_FIELDS


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first prompt token of an echoed prompt
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: CompletionLogprobs | None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # when asked for (vLLM's)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None  # --reasoning-parser (also as ``reasoning``)
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # when asked for (vLLM's)


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # a string: base64 of little-endian float32 (encoding_format "base64")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None
    max_model_len: int
    vocab_size: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok"]
    runtime: dict[str, Any]
    circuit: dict[str, Any] | None = None
    fallback: dict[str, Any] | None = None


class VersionResponse(BaseModel):
    version: str
    runtime: dict[str, Any]


class KVCacheState(BaseModel):
    """The block pool as it is now: after every request has ended, num_free_blocks == num_blocks."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage: float
    num_running: int
    num_waiting: int
    num_swapped: int
    num_host_blocks: int
    num_free_host_blocks: int
    consistent: bool
    problem: str | None = None
    kv_bytes_per_request: dict[str, int] = {}  # running requests: the KV bytes their blocks hold
    kv_layer_groups: int = 1  # block tables per request (sliding-window layers form groups of their own)
    # a hybrid model's recurrent-state slots: num_slots, num_held, num_free, num_snapshots, bytes_per_slot
    state_slots: dict[str, int] | None = None


class AnthropicTextContent(BaseModel):
    type: Literal["text"]
    text: str


class AnthropicThinkingContent(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str


class AnthropicToolUseContent(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class AnthropicMessageResponse(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicThinkingContent | AnthropicTextContent | AnthropicToolUseContent]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn"]
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicCountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorInfo


_ERROR_TEXT = {400: "invalid request (OpenAI error object)", 401: "missing or wrong API key",
               404: "unknown model or route", 413: "request body too large",
               429: "queue full (Retry-After header)", 500: "the engine failed on this request",
               503: "overloaded, shutting down or engine not running (Retry-After header when overloaded)"}


def errors(*codes: int) -> dict[int | str, dict]:
    return {c: {"model": ErrorResponse, "description": _ERROR_TEXT[c]} for c in codes}


def anthropic_errors(*codes: int) -> dict[int | str, dict]:
    return {c: {"model": AnthropicErrorResponse, "description": _ERROR_TEXT[c].replace("OpenAI", "Anthropic")}
            for c in codes}


_STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "server-sent events: `data: <chunk "
                                            "JSON>` lines, then `data: [DONE]`"}}}
GENERATE_RESPONSES = {200: {"description": "JSON, or an SSE stream when `stream` is true", "content": _STREAM},
                      **errors(400, 401, 404, 413, 429, 500, 503)}
SIMPLE_RESPONSES = errors(400, 401, 404, 413)
_RESPONSES_STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "server-sent events: "
                                                       "`event: <type>` and `data: <event JSON>` lines "
                                                       "(response.created ... response.completed; error)"}}}
RESPONSES_RESPONSES = {200: {"description": "the response object as JSON, or an SSE stream of its events when "
                                            "`stream` is true", "content": {"application/json": {"schema": {
                                                "type": "object"}}, **_RESPONSES_STREAM}},
                       **errors(400, 401, 404, 413, 429, 500, 503)}
EMBEDDING_RESPONSES = {200: {"model": EmbeddingResponse}, **errors(400, 401, 404, 413, 429, 500, 503)}
SCORE_RESPONSES = errors(400, 401, 404, 413, 429, 500, 503)
_ANTHROPIC_STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "server-sent events: "
                                                      "`event: <type>` and `data: <event JSON>` lines (message_start, "
                                                      "content_block_start/_delta/_stop, message_delta, message_stop; "
                                                      "error)"}}}
MESSAGES_RESPONSES = {200: {"model": AnthropicMessageResponse, "content": _ANTHROPIC_STREAM,
                            "description": "the message as JSON, or an SSE stream of Anthropic's events when `stream` "
                                           "is true"},
                      **anthropic_errors(400, 401, 404, 413, 429, 500, 503)}
COUNT_TOKENS_RESPONSES = {200: {"model": AnthropicCountTokensResponse}, **anthropic_errors(400, 401, 404, 413)}
# request bodies: the hint fields each accepts besides its own (every other field is refused)
_REQUESTS = {"CompletionRequest": HINT_FIELDS, "ChatCompletionRequest": HINT_FIELDS, "EmbeddingRequest": HINT_FIELDS,
             "RerankRequest": HINT_FIELDS, "ScoreRequest": HINT_FIELDS, "ResponsesRequest": RESPONSES_HINT_FIELDS,
             "AnthropicMessagesRequest": ANTHROPIC_HINT_FIELDS, "AnthropicCountTokensRequest": ANTHROPIC_HINT_FIELDS}


def finalize(schema: dict, ranges: dict, require_key: frozenset[str] | None) -> dict:
    """Edit FastAPI's generated schema in place: 400 instead of 422, numeric ranges, closed request objects
    (``additionalProperties: false`` plus the accepted hint fields), the key schemes on protected routes."""
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
            if require_key is not None and path not in require_key:
                op["security"] = [{"bearer": []}] + ([{"x-api-key": []}] if anthropic_route(path) else [])
    if require_key is not None:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                   "x-api-key": {"type": "apiKey", "in": "header",
                                                                 "name": "x-api-key"}}
    for name, hints in _REQUESTS.items():
        model = comps.get(name)
        if model is None:
            continue
        props = model["properties"]
        for field, r in ranges.items():
            key = "top_logprobs" if (field == "logprobs" and name == "ChatCompletionRequest") else field
            if key in props:
                _constrain(props[key], r.json_schema())
        if name == "ChatCompletionRequest" and "max_completion_tokens" in props:
            _constrain(props["max_completion_tokens"], ranges["max_tokens"].json_schema())
        for hint in sorted(hints):
            props.setdefault(hint, {"description": "accepted and ignored (a hint that does not change the output)"})
        model["additionalProperties"] = False
    return schema


def _constrain(prop: dict, limits: dict) -> None:
    """Put the numeric limits on the number branch of a property (``anyOf`` with null, or a plain type)."""
    branches = prop.get("anyOf", [prop])
    for b in branches:
        if b.get("type") in ("integer", "number"):
            b.update({k: v for k, v in limits.items() if k != "type"})
            if limits["type"] == "integer":
                b["type"] = "integer"
