"""`/v1/chat/completions`: messages through the chat template, n choices, tool calls, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import Request

from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.server.degradation import FallbackRouter
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import ChatCompletionRequest
from pagedllm.server.reasoning import ReasoningParser, make_reasoning_parser
from pagedllm.server.serving_base import OpenAIServing, prompt_logprobs_json
from pagedllm.server.streaming import ChoiceDeltas, Reply, final_outputs
from pagedllm.server.tools import ToolPlan, extract_tool_calls, plan_tools, stream_view, template_messages


def chat_logprobs(lps: list[TokenLogprobs]) -> dict:
    def entry(tok: str, lp: float) -> dict:
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    return {"content": [
        {**entry(lp.decoded_token, lp.logprob), "top_logprobs": [entry(t.decoded_token, t.logprob) for t in lp.top]}
        for lp in lps
    ]}


def _messages(req: ChatCompletionRequest) -> list[dict]:
    """The request's messages as the chat template takes them (content parts: only text is supported)."""
    messages = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
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
    return template_messages(messages)


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt: its tool plan, its output constraint, the messages and tools the chat template renders,
    their encoding for the primary engine, and whether the output is read for reasoning (--reasoning-parser) and
    starts inside it (the prompt has not closed it already, as Qwen 3's template does with enable_thinking off)."""

    plan: ToolPlan
    structured: StructuredOutputsParams | None
    messages: list[dict]
    tools: list[dict] | None
    encoded: tuple[str, list[int]]
    reasoning: bool = False
    thinking: bool = False


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, model_names: list[str], router: FallbackRouter,
                 auto_tools: bool = False, reasoning_parser: str | None = None,
                 structured_in_reasoning: bool = False, tool_call_parser: str | None = None) -> None:
        super().__init__(engine, model_names, router)
        self.auto_tools = auto_tools  # --enable-auto-tool-choice with a --tool-call-parser
        self.tool_call_parser = tool_call_parser or "hermes"
        self._reasoning = None if reasoning_parser is None else make_reasoning_parser(reasoning_parser)
        # --structured-outputs-in-reasoning: a constraint covers the whole output, reasoning included (by default it
        # applies to the answer after the reasoning)
        self.structured_in_reasoning = structured_in_reasoning

    def reasoning_parser(self, p: ChatPrompt) -> ReasoningParser | None:
        """A fresh parser for one output (--reasoning-parser), or None: no parser, or a tool choice that constrains
        the whole output to its JSON (there is no reasoning to read)."""
        if not p.reasoning:
            return None
        return self._reasoning.fresh(closed=not p.thinking)

    def split_reasoning(self, p: ChatPrompt, text: str) -> tuple[str | None, str]:
        """(reasoning, the content the tool parser reads) of a finished output."""
        parser = self.reasoning_parser(p)
        if parser is None:
            return None, text
        reasoning, content = parser.split(text)
        return reasoning, content or ""

    def prompt(self, req: ChatCompletionRequest) -> ChatPrompt:
        """The request's tool plan and constraint, and its messages rendered by the chat template and encoded (a
        template error is a 400 before anything is queued)."""
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.auto_tools, self.tool_call_parser)
        structured = req.structured()
        if plan.structured is not None:
            if structured is not None:
                raise APIError(400, f"tool_choice {plan.mode!r} constrains the output itself: it cannot be combined "
                                    "with response_format or guided decoding", "tool_choice")
            structured = plan.structured
        tools = req.tools if plan.mode != "none" else None
        messages = _messages(req)
        encoded = self.engine.encode_chat(messages, tools, req.chat_template_kwargs)
        # with a reasoning parser, a constraint applies to the answer: from the token after the output's </think>
        # (harmony: its final channel's header), or from the start where the prompt has closed the reasoning itself
        reasoning = self._reasoning is not None and not (
            self.structured_in_reasoning and plan.mode in ("named", "required"))
        marker = self._reasoning.answer_marker if self._reasoning is not None else ""
        thinking = reasoning and not encoded[0].rstrip().endswith(marker)
        if thinking and structured is not None and not self.structured_in_reasoning:
            structured = replace(structured, after=marker)
        return ChatPrompt(plan, structured, messages, tools, encoded, reasoning, thinking)

    async def begin(self, req: ChatCompletionRequest, raw: Request,
                    logprobs: int | None = None) -> tuple[ChatPrompt, list[AsyncIterator], str]:
        """Check, render and queue a chat request: its prompt (tool plan, reasoning), its output streams and the
        model serving them."""
        model = self.check_generative(req.model)
        self.refuse_unsupported(req)
        p = self.prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = req.to_sampling_params(max_tokens, logprobs, p.structured)
        if p.reasoning and self._reasoning.keeps_special_tokens:  # harmony's tags are special tokens: kept to parse
            params = replace(params, skip_special_tokens=False)
        gens, model = await self.start(lambda eng: [eng.encode_chat(p.messages, p.tools, req.chat_template_kwargs)],
                                       [p.encoded], params, req, model, raw)
        return p, gens, model

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        p, gens, model = await self.begin(req, raw, (req.top_logprobs or 0) if req.logprobs else None)
        plan = p.plan
        reply = Reply("chatcmpl", model)

        if not req.stream:
            finals = await final_outputs(gens, raw)
            choices = []
            for c in finals[0].outputs:
                reasoning, text = self.split_reasoning(p, c.text)
                content, calls = extract_tool_calls(plan, text)
                message = {"role": "assistant", "content": content}
                if reasoning is not None:  # vLLM's field, and its newer name
                    message["reasoning_content"] = message["reasoning"] = reasoning
                    message["content"] = content or None
                if calls:
                    message["tool_calls"] = calls
                choices.append({
                    "index": c.index, "message": message,
                    "logprobs": chat_logprobs(c.logprobs) if c.logprobs is not None else None,
                    "finish_reason": "tool_calls" if calls else c.finish_reason, "stop_reason": c.stop_reason,
                })
            extra = {} if req.prompt_logprobs is None else {
                "prompt_logprobs": prompt_logprobs_json(finals[0].prompt_logprobs)}
            return reply.json("chat.completion", choices, finals, extra)

        parsers: dict[int, ReasoningParser | None] = {}

        def render(_prompt: int, _output: RequestOutput, index: int, c: CompletionOutput,
                   deltas: ChoiceDeltas) -> dict | None:
            finished = c.finish_reason is not None
            if index not in parsers:
                parsers[index] = self.reasoning_parser(p)
            parser, reasoning, text = parsers[index], "", c.text
            if parser is not None:
                reasoning, text = parser.advance(c.text, finished)
            shown, calls = stream_view(plan, text, finished)
            d = deltas.next(index, shown, c)
            if d is None and not reasoning:
                return None
            delta = {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
            if d is not None and d.text:
                delta["content"] = d.text
            if calls:
                delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(calls)]
            lps = d.logprobs if d is not None else None
            return {"index": index, "delta": delta, "logprobs": chat_logprobs(lps) if lps is not None else None,
                    "finish_reason": "tool_calls" if calls else c.finish_reason}

        opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                   for i in range(req.n)]
        return reply.sse("chat.completion.chunk", gens, req.n, req.stream_options, render, opening)
