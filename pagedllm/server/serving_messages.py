"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the chat completions
machinery: the request becomes a chat completion request (``AnthropicCountTokensRequest.to_chat``) that the chat
endpoint checks, renders through the chat template, constrains (``tool_choice``) and queues; this module draws the
result as Anthropic's message, or as its SSE events (``message_start``, a ``content_block_start`` /
``content_block_delta`` / ``content_block_stop`` run per ``thinking`` (``--reasoning-parser``), text or ``tool_use``
block, ``message_delta``, ``message_stop``). Errors on these routes are Anthropic's error object (``errors.error_json``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedllm.outputs import CompletionOutput
from pagedllm.server.errors import anthropic_error
from pagedllm.server.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from pagedllm.server.reasoning import ReasoningParser
from pagedllm.server.serving_chat import OpenAIServingChat
from pagedllm.server.streaming import ChoiceDeltas, Reply, error_status, final_outputs, named_event
from pagedllm.server.tools import ToolPlan, extract_tool_calls, stream_view


def error_event(e: Exception) -> str:
    return named_event(anthropic_error(error_status(e), str(e)))


def tool_use_blocks(calls: list[dict]) -> list[dict]:
    """Parsed tool calls as ``tool_use`` blocks; a call whose arguments are not a JSON object (cut short by
    max_tokens) is left out."""
    blocks = []
    for call in calls:
        try:
            args = json.loads(call["function"]["arguments"])
        except ValueError:
            continue
        if isinstance(args, dict):
            blocks.append({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                           "name": call["function"]["name"], "input": args})
    return blocks


def thinking_block(reasoning: str) -> dict:
    """Reasoning (--reasoning-parser) as a ``thinking`` block (no signature: nothing here checks one)."""
    return {"type": "thinking", "thinking": reasoning, "signature": ""}


def stop_reason(c: CompletionOutput, tool_use: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished output. A request the server ended early (shutdown
    drain: finish reason ``abort``) is ``pause_turn``: sending the turn back continues it."""
    if tool_use:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.finish_reason == "abort":
        return "pause_turn", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def count_tokens(self, req: AnthropicCountTokensRequest) -> dict:
        """The prompt length a Messages request with this body has (its ``usage.input_tokens``)."""
        self.chat.check_generative(req.model)
        self.chat.refuse_unsupported(req)
        return {"input_tokens": len(self.chat.prompt(req.to_chat()).encoded[1])}

    async def create_message(self, req: AnthropicMessagesRequest, raw: Request):
        self.chat.refuse_unsupported(req)
        p, gens, model = await self.chat.begin(req.to_chat(), raw)
        reply = Reply("msg", model, sep="_")
        if req.stream:
            return reply.stream(self._events(reply, p.plan, gens[0], self.chat.reasoning_parser(p)), error_event)
        final = (await final_outputs(gens, raw))[0]
        c = final.outputs[0]
        reasoning, text = self.chat.split_reasoning(p, c.text)
        content, calls = extract_tool_calls(p.plan, text)
        tool_use = tool_use_blocks(calls)
        blocks = ([thinking_block(reasoning)] if reasoning else []) + (
            [{"type": "text", "text": content}] if content else []) + tool_use
        usage = {"input_tokens": len(final.prompt_token_ids), "output_tokens": len(c.token_ids)}
        return JSONResponse(_message(reply, blocks, stop_reason(c, bool(tool_use)), usage), headers=reply.headers)

    @staticmethod
    async def _events(reply: Reply, plan: ToolPlan, gen: AsyncIterator,
                      parser: ReasoningParser | None) -> AsyncIterator[str]:
        """The SSE events of one output stream: reasoning (``parser``) streams as a ``thinking`` block, then text
        streams as it comes (what may be a tool call is held back, as on the chat endpoint); tool calls follow as
        whole ``tool_use`` blocks once the output has finished."""
        deltas = ChoiceDeltas()
        index = 0  # of the content block being written
        started = text_open = thinking_open = False
        try:
            async for o in gen:
                c = o.outputs[0]
                if not started:
                    started = True
                    usage = {"input_tokens": len(o.prompt_token_ids), "output_tokens": 0}
                    yield named_event({"type": "message_start", "message": _message(reply, [], (None, None), usage)})
                    yield named_event({"type": "ping"})
                finished = c.finish_reason is not None
                reasoning, text = parser.advance(c.text, finished) if parser is not None else ("", c.text)
                if reasoning:
                    if not thinking_open:
                        yield named_event({"type": "content_block_start", "index": index,
                                     "content_block": thinking_block("")})
                        thinking_open = True
                    yield named_event({"type": "content_block_delta", "index": index,
                                 "delta": {"type": "thinking_delta", "thinking": reasoning}})
                shown, calls = stream_view(plan, text, finished)
                d = deltas.next(0, shown, c)
                if thinking_open and (finished or (d is not None and d.text)):  # the reasoning is over
                    yield named_event({"type": "content_block_delta", "index": index,
                                 "delta": {"type": "signature_delta", "signature": ""}})
                    yield named_event({"type": "content_block_stop", "index": index})
                    index += 1
                    thinking_open = False
                if d is not None and d.text:
                    if not text_open:
                        yield named_event({"type": "content_block_start", "index": index,
                                     "content_block": {"type": "text", "text": ""}})
                        text_open = True
                    yield named_event({"type": "content_block_delta", "index": index,
                                 "delta": {"type": "text_delta", "text": d.text}})
                if c.finish_reason is None:
                    continue
                if text_open:
                    yield named_event({"type": "content_block_stop", "index": index})
                    index += 1
                blocks = tool_use_blocks(calls)
                for b in blocks:
                    yield named_event({"type": "content_block_start", "index": index,
                                       "content_block": {**b, "input": {}}})
                    yield named_event({"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)}})
                    yield named_event({"type": "content_block_stop", "index": index})
                    index += 1
                reason, sequence = stop_reason(c, bool(blocks))
                yield named_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                             "usage": {"output_tokens": len(c.token_ids)}})
                yield named_event({"type": "message_stop"})
        finally:
            await gen.aclose()  # ended early (the client went away): abort the request


def _message(reply: Reply, content: list[dict], stop: tuple[str | None, str | None], usage: dict) -> dict:
    return {"id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}
