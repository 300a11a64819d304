"""OpenAI's Responses API (`POST /v1/responses`), stateless, over the chat completions machinery: the request
becomes a chat completion request (``ResponsesRequest.to_chat``) that the chat endpoint checks, renders, constrains
(``tool_choice``, ``text.format``) and queues; this module draws the result as a response object whose output items
are a ``reasoning`` item (``--reasoning-parser``), a ``message`` with ``output_text``, and ``function_call`` items,
or as the documented SSE event sequence (``response.created``, ``response.in_progress``, per item
``response.output_item.added`` ... ``response.output_item.done`` with text / reasoning / argument deltas between,
``response.completed`` or ``response.incomplete``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.server.protocol import ResponsesRequest
from pagedllm.server.serving_chat import ChatPrompt, OpenAIServingChat
from pagedllm.server.streaming import ChoiceDeltas, Reply, error_status, final_outputs, named_event
from pagedllm.server.tools import extract_tool_calls, stream_view


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text)]}


def call_items(calls: list[dict]) -> list[dict]:
    return [{"type": "function_call", "id": "fc_" + c["id"].removeprefix("call_"), "call_id": c["id"],
             "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
            for c in calls]


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_response(self, req: ResponsesRequest, raw: Request):
        self.chat.refuse_unsupported(req)
        chat_req = req.to_chat()
        p, gens, model = await self.chat.begin(chat_req, raw)
        reply = Reply("resp", model, sep="_")
        base = self._base(req, reply)
        if req.stream:
            events = self._events(base, p, gens[0])
            return reply.stream(events, lambda e: named_event({"type": "error", "code": str(error_status(e)),
                                                               "message": str(e), "param": None,
                                                               "sequence_number": 0}))
        final = (await final_outputs(gens, raw))[0]
        c = final.outputs[0]
        reasoning, text = self.chat.split_reasoning(p, c.text)
        content, calls = extract_tool_calls(p.plan, text)
        output = ([reasoning_item(_id("rs"), reasoning)] if reasoning else []) + (
            [message_item(_id("msg"), content)] if content else []) + call_items(calls)
        return JSONResponse(_finish(base, output, final, c), headers=reply.headers)

    @staticmethod
    def _base(req: ResponsesRequest, reply: Reply) -> dict:
        """The response object's fields that echo the request."""
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {"id": reply.id, "object": "response", "created_at": reply.created, "status": "in_progress",
                "model": reply.model, "output": [], "error": None, "incomplete_details": None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "temperature": 1.0 if req.temperature is None else req.temperature,
                "top_p": 1.0 if req.top_p is None else req.top_p, "tools": req.tools or [],
                "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls,
                "text": {"format": fmt}, "store": False, "previous_response_id": None,
                "metadata": req.metadata or {}, "truncation": "disabled", "usage": None}

    async def _events(self, base: dict, p: ChatPrompt, gen: AsyncIterator) -> AsyncIterator[str]:
        """The SSE events of one output stream: reasoning streams as a reasoning item, text as a message's output
        text (what may be a tool call held back, as on the chat endpoint), tool calls as whole function_call
        items once the output has finished."""
        seq = iter(range(1 << 62))
        plan, parser = p.plan, self.chat.reasoning_parser(p)
        deltas = ChoiceDeltas()
        items: list[dict] = []  # finished output items
        open_kind: str | None = None  # "reasoning" | "message": the item being streamed
        item_id, acc = "", ""

        def ev(obj: dict) -> str:
            return named_event({**obj, "sequence_number": next(seq)})

        def close() -> list[str]:
            nonlocal open_kind
            i = len(items)
            if open_kind == "reasoning":
                item = reasoning_item(item_id, acc)
                out = [ev({"type": "response.reasoning_text.done", "item_id": item_id, "output_index": i,
                           "content_index": 0, "text": acc})]
            else:
                item = message_item(item_id, acc)
                out = [ev({"type": "response.output_text.done", "item_id": item_id, "output_index": i,
                           "content_index": 0, "text": acc, "logprobs": []}),
                       ev({"type": "response.content_part.done", "item_id": item_id, "output_index": i,
                           "content_index": 0, "part": text_part(acc)})]
            out.append(ev({"type": "response.output_item.done", "output_index": i, "item": item}))
            items.append(item)
            open_kind = None
            return out

        def open_(kind: str) -> list[str]:
            nonlocal open_kind, item_id, acc
            open_kind, acc = kind, ""
            i = len(items)
            if kind == "reasoning":
                item_id = _id("rs")
                return [ev({"type": "response.output_item.added", "output_index": i,
                            "item": reasoning_item(item_id, "", "in_progress")})]
            item_id = _id("msg")
            return [ev({"type": "response.output_item.added", "output_index": i,
                        "item": message_item(item_id, None, "in_progress")}),
                    ev({"type": "response.content_part.added", "item_id": item_id, "output_index": i,
                        "content_index": 0, "part": text_part("")})]

        try:
            yield ev({"type": "response.created", "response": base})
            yield ev({"type": "response.in_progress", "response": base})
            async for o in gen:
                c = o.outputs[0]
                finished = c.finish_reason is not None
                reasoning, text = parser.advance(c.text, finished) if parser is not None else ("", c.text)
                shown, calls = stream_view(plan, text, finished)
                d = deltas.next(0, shown, c)
                for kind, delta in (("reasoning", reasoning), ("message", d.text if d is not None else "")):
                    if not delta:
                        continue
                    if open_kind != kind:
                        for line in (close() if open_kind else []) + open_(kind):
                            yield line
                    acc += delta
                    name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                    extra = {} if kind == "reasoning" else {"logprobs": []}
                    yield ev({"type": name, "item_id": item_id, "output_index": len(items), "content_index": 0,
                              "delta": delta, **extra})
                if not finished:
                    continue
                if open_kind:
                    for line in close():
                        yield line
                for item in call_items(calls):
                    i = len(items)
                    yield ev({"type": "response.output_item.added", "output_index": i,
                              "item": {**item, "arguments": "", "status": "in_progress"}})
                    yield ev({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                              "output_index": i, "delta": item["arguments"]})
                    yield ev({"type": "response.function_call_arguments.done", "item_id": item["id"],
                              "output_index": i, "name": item["name"], "arguments": item["arguments"]})
                    yield ev({"type": "response.output_item.done", "output_index": i, "item": item})
                    items.append(item)
                done = _finish(base, items, o, c)
                yield ev({"type": "response.completed" if done["status"] == "completed" else "response.incomplete",
                          "response": done})
        finally:
            await gen.aclose()  # ended early (the client went away): abort the request


def _finish(base: dict, output: list[dict], final: RequestOutput, c: CompletionOutput) -> dict:
    """The finished response: its output items, status (incomplete when cut by max_output_tokens) and usage."""
    incomplete = c.finish_reason == "length" or c.finish_reason == "abort"
    reason = "max_output_tokens" if c.finish_reason == "length" else "interrupted"
    n_in, n_out = len(final.prompt_token_ids), len(c.token_ids)
    return {**base, "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": reason} if incomplete else None, "output": output,
            "completed_at": int(time.time()),
            "usage": {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                      "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": n_in + n_out}}

