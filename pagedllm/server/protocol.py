"""Request models (pydantic): OpenAI's protocol, and Anthropic's Messages API, which maps onto a chat completion
request (``AnthropicCountTokensRequest.to_chat``).

A field the server does not implement is refused (400 naming it) rather than silently ignored, except the ones
OpenAI documents as optional hints that do not change the output (``HINT_FIELDS``; Anthropic's:
``ANTHROPIC_HINT_FIELDS``) and other engines' fields at the values that ask for what pagedllm does anyway
(``NEUTRAL_FIELDS``)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

# accepted and ignored: bookkeeping and routing hints that do not change what is generated
HINT_FIELDS = frozenset({"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                         "prediction", "reasoning_effort", "verbosity"})
# SGLang's and vLLM's generation fields that routers in front of them (vllm-router, sglang-router) write into every
# request they forward, at these values: what pagedllm does anyway (no hidden states returned, no continued final
# message, a --reasoning-parser's reasoning included, separated and streamed), so they are accepted; any other value
# would change the answer and stays a 400 naming the field
NEUTRAL_FIELDS = {"return_hidden_states": False, "continue_final_message": False, "include_reasoning": True,
                  "separate_reasoning": True, "stream_reasoning": True}


def _unsupported(extra: dict[str, Any] | None, hints: frozenset[str]) -> list[str]:
    """The extra fields of a request that are neither hints nor neutral fields at their neutral value."""
    return sorted(k for k, v in (extra or {}).items()
                  if k not in hints and not (k in NEUTRAL_FIELDS and v is NEUTRAL_FIELDS[k]))


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False  # SGLang's name for include_stop_str_in_output (routers send it on every request)
    skip_special_tokens: bool = True
    priority: int = 0
    max_queue_delay_ms: float | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many top alternatives
    # structured outputs: vLLM's extra parameters, its newer object, and (chat) OpenAI's response_format
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def unsupported_fields(self) -> list[str]:
        return _unsupported(self.model_extra, HINT_FIELDS)

    def structured(self) -> StructuredOutputsParams | None:
        """The request's constraint (at most one way of giving it), or None."""
        given = {k: getattr(self, k) for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                                "structured_outputs") if getattr(self, k) is not None}
        rf = self._response_format()
        if rf is not None:
            given["response_format"] = rf
        if len(given) > 1:
            raise ValueError(f"give one structured output constraint, got {sorted(given)}")
        if not given:
            return None
        (key, v), = given.items()
        if key == "structured_outputs":
            return StructuredOutputsParams.from_dict(v)
        if key == "response_format":
            return v
        return StructuredOutputsParams(**{key.removeprefix("guided_"): v})

    def _response_format(self) -> StructuredOutputsParams | None:
        return None

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           structured: StructuredOutputsParams | None = None,
                           prompt_logprobs: int | None = None) -> SamplingParams:
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids (integers as strings)") from None
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=bias,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``: one vector per input (a text, token ids, or a list of either)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # pagedllm's / vLLM's: how hidden states become the vector, and queueing
    pooling: Literal["last", "mean", "cls"] | None = None  # None: the server's (--pooling)
    normalize: bool | None = None  # None: an embedding model's own (its Normalize module), else True
    # an embedding model's prompt (sentence-transformers' prompt_name: EmbeddingGemma's "query", "document", ...)
    prompt_name: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: cut longer inputs to this many tokens (-1: the maximum)
    priority: int = 0
    max_queue_delay_ms: float | None = None

    def unsupported_fields(self) -> list[str]:
        return _unsupported(self.model_extra, HINT_FIELDS)


class _EmbeddingOptions(BaseModel):
    """What the rerank and score requests share with embeddings."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    max_queue_delay_ms: float | None = None

    def unsupported_fields(self) -> list[str]:
        return _unsupported(self.model_extra, HINT_FIELDS)


class RerankRequest(_EmbeddingOptions):
    """``POST /v1/rerank`` (Jina's and Cohere's shape, as vLLM and llama.cpp serve it): the documents ordered by
    their relevance to the query."""

    query: str
    documents: list[str | dict[str, Any]] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


class ScoreRequest(_EmbeddingOptions):
    """``POST /score`` (vLLM's): a score per pair, ``text_1`` against each of ``text_2`` (or pairwise when both
    are lists of one length)."""

    text_1: str | list[str]
    text_2: str | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (vLLM's; e.g. enable_thinking)
    parallel_tool_calls: bool = True

    def _response_format(self) -> StructuredOutputsParams | None:
        rf = self.response_format
        if rf is None or rf.get("type") == "text":
            return None
        if rf.get("type") == "json_object":
            return StructuredOutputsParams(json_object=True)
        if rf.get("type") == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise ValueError("response_format.json_schema must be an object with a 'schema'")
            return StructuredOutputsParams(json=js.get("schema", {"type": "object"}))
        raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {rf.get('type')!r}")


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------- Anthropic's Messages API
# accepted and ignored: bookkeeping, routing and caching hints (prefix caching is automatic; ``cache_control`` on
# blocks and tools is accepted too)
ANTHROPIC_HINT_FIELDS = frozenset({"service_tier", "inference_geo", "speed", "cache_control", "diagnostics",
                                   "user_profile_id", "workspace_id"})
_CLOSED = ConfigDict(extra="forbid")


class AnthropicTextBlock(BaseModel):
    model_config = _CLOSED

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class AnthropicToolUseBlock(BaseModel):
    model_config = _CLOSED

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class AnthropicToolResultBlock(BaseModel):
    model_config = _CLOSED

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[AnthropicTextBlock] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {text}" if self.is_error else text


AnthropicBlock = Annotated[Union[AnthropicTextBlock, AnthropicToolUseBlock, AnthropicToolResultBlock],
                           Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    model_config = _CLOSED

    role: Literal["user", "assistant"]
    content: list[AnthropicBlock] | str


class AnthropicTool(BaseModel):
    model_config = _CLOSED

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(BaseModel):
    model_config = _CLOSED

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicOutputFormat(BaseModel):
    model_config = _CLOSED

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class AnthropicOutputConfig(BaseModel):
    """Structured output (``format``: the answer's text follows a JSON schema); ``effort`` is accepted and ignored."""

    model_config = _CLOSED

    format: AnthropicOutputFormat | None = None
    effort: str | None = None


def _text_parts(blocks: list[AnthropicTextBlock]) -> list[dict]:
    return [{"type": "text", "text": b.text} for b in blocks]


def _chat_messages(m: AnthropicMessage) -> list[dict]:
    """One Anthropic message as chat messages: an assistant's text and ``tool_use`` blocks become one message with
    ``tool_calls``; a user's ``tool_result`` blocks become ``tool`` messages and its text a user message, in order."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "assistant":
        if any(isinstance(b, AnthropicToolResultBlock) for b in m.content):
            raise ValueError("messages: tool_result blocks belong in user messages")
        msg: dict = {"role": "assistant", "content": _text_parts([b for b in m.content
                                                                   if isinstance(b, AnthropicTextBlock)])}
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                 for b in m.content if isinstance(b, AnthropicToolUseBlock)]
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    out: list[dict] = []
    for b in m.content:
        if isinstance(b, AnthropicToolUseBlock):
            raise ValueError("messages: tool_use blocks belong in assistant messages")
        if isinstance(b, AnthropicToolResultBlock):
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        elif out and out[-1]["role"] == "user":
            out[-1]["content"].append({"type": "text", "text": b.text})
        else:
            out.append({"role": "user", "content": _text_parts([b])})
    return out or [{"role": "user", "content": ""}]


class AnthropicCountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: what a Messages request renders to, without the sampling fields."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicTextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    output_config: AnthropicOutputConfig | None = None

    def unsupported_fields(self) -> list[str]:
        return sorted(set(self.model_extra or {}) - ANTHROPIC_HINT_FIELDS)

    def to_chat(self, **sampling: Any) -> ChatCompletionRequest:
        """The same request as a chat completion request (``sampling``: its sampling fields); ValueError for what
        has no equivalent."""
        if self.messages[-1].role == "assistant":
            raise ValueError("messages: a final assistant message (prefilling the response) is not supported")
        messages: list[dict] = []
        if self.system:
            messages.append({"role": "system", "content": self.system if isinstance(self.system, str)
                             else _text_parts(self.system)})
        for m in self.messages:
            messages += _chat_messages(m)
        tools = None if self.tools is None else [
            {"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in self.tools]
        tool_choice: str | dict | None = None
        parallel = True
        tc = self.tool_choice
        if tc is not None:
            if tc.type == "tool":
                if tc.name is None:
                    raise ValueError("tool_choice: type 'tool' needs a name")
                tool_choice = {"type": "function", "function": {"name": tc.name}}
            else:
                tool_choice = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
            parallel = not tc.disable_parallel_tool_use
        fmt = self.output_config.format if self.output_config is not None else None
        response_format = None if fmt is None else {"type": "json_schema", "json_schema": {"schema": fmt.schema_}}
        return ChatCompletionRequest(model=self.model, messages=messages, tools=tools, tool_choice=tool_choice,
                                     parallel_tool_calls=parallel, response_format=response_format, **sampling)


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False

    def to_chat(self, **sampling: Any) -> ChatCompletionRequest:
        return super().to_chat(max_tokens=self.max_tokens, stop=self.stop_sequences, temperature=self.temperature,
                               top_p=self.top_p, top_k=self.top_k, stream=self.stream, **sampling)


# Responses API: accepted and ignored (bookkeeping, or a hint that does not change what is generated)
RESPONSES_HINT_FIELDS = HINT_FIELDS | {"truncation", "reasoning", "include", "background", "max_tool_calls"}


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (OpenAI's Responses API), stateless: nothing is stored, so ``store: true`` and
    ``previous_response_id`` are refused; it maps onto a chat completion request (``to_chat``)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None

    def unsupported_fields(self) -> list[str]:
        return sorted(set(self.model_extra or {}) - RESPONSES_HINT_FIELDS)

    def to_chat(self) -> ChatCompletionRequest:
        """The same request as a chat completion request; ValueError for what has no equivalent."""
        if self.store:
            raise ValueError("store: pagedllm keeps no responses; send store=false (or leave it out)")
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id: pagedllm keeps no responses; send the whole conversation as "
                             "input items")
        messages: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for item in self.input:
                _responses_item(item, messages)
        if not messages:
            raise ValueError("input: at least one message is required")
        tools = None
        if self.tools is not None:
            tools = []
            for t in self.tools:
                if t.get("type") != "function" or not isinstance(t.get("name"), str):
                    raise ValueError(f"tools: only function tools (type 'function' with a name) are supported, got "
                                     f"type {t.get('type')!r}")
                tools.append({"type": "function", "function": {
                    "name": t["name"], "description": t.get("description") or "",
                    "parameters": t.get("parameters") or {"type": "object", "properties": {}}}})
        tool_choice = self.tool_choice
        if isinstance(tool_choice, dict):
            if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
                raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")
            tool_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
        fmt = (self.text or {}).get("format") or {"type": "text"}
        kind = fmt.get("type")
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise ValueError("text.format: a json_schema format needs a schema object")
            response_format = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                                      "schema": fmt["schema"]}}
        elif kind == "json_object":
            response_format = {"type": "json_object"}
        elif kind == "text":
            response_format = None
        else:
            raise ValueError(f"text.format type must be 'text', 'json_schema' or 'json_object', got {kind!r}")
        return ChatCompletionRequest(
            model=self.model, messages=messages, tools=tools, tool_choice=tool_choice,
            parallel_tool_calls=self.parallel_tool_calls, response_format=response_format,
            max_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p, stream=self.stream)


def _responses_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("input: a message's content must be a string or a list of content parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ValueError(f"input: content part type {kind!r} is not supported (text only)")
        parts.append(part.get("text") or "")
    return "".join(parts)


def _responses_item(item: dict, messages: list[dict]) -> None:
    """Append one Responses input item to chat ``messages``: a message, a function call (joined to the assistant
    turn it belongs to) or a function call's output; reasoning items are not sent back to the model."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise ValueError(f"input: message role must be user, assistant, system or developer, got {role!r}")
        messages.append({"role": "system" if role == "developer" else role,
                         "content": _responses_text(item.get("content", ""))})
    elif kind == "function_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise ValueError("input: a function_call item needs call_id, name and arguments (strings)")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if not (messages and messages[-1]["role"] == "assistant"):
            messages.append({"role": "assistant", "content": ""})
        messages[-1].setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        out = item.get("output")
        if not isinstance(item.get("call_id"), str) or out is None:
            raise ValueError("input: a function_call_output item needs call_id and output")
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _responses_text(out)})
    elif kind != "reasoning":
        raise ValueError(f"input: item type {kind!r} is not supported")
