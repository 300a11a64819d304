"""OpenAI protocol request models (pydantic).

A field the server does not implement is refused (400 naming it) rather than silently ignored, except the ones
OpenAI documents as optional hints that do not change the output (``HINT_FIELDS``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

# accepted and ignored: bookkeeping and routing hints that do not change what is generated
HINT_FIELDS = frozenset({"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                         "prediction", "reasoning_effort", "verbosity"})


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
    skip_special_tokens: bool = True
    priority: int = 0
    max_queue_delay_ms: float | None = None
    # structured outputs: vLLM's extra parameters, its newer object, and (chat) OpenAI's response_format
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def unsupported_fields(self) -> list[str]:
        return sorted(set(self.model_extra or {}) - HINT_FIELDS)

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
                           structured: StructuredOutputsParams | None = None) -> SamplingParams:
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
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
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
