"""From a request's output streams to its HTTP response, for both generate endpoints: waiting for the first or final
outputs while watching the client, interleaving the streams of several prompts, usage, and the SSE body (each
choice's new text and logprobs per chunk, the usage chunk, errors, ``[DONE]``). The endpoints give only what
differs: the object names and how a choice is drawn."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.errors import EngineDeadError, EngineOverloadedError, RequestFailedError
from pagedllm.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagedllm.server.errors import ClientGone
from pagedllm.server.protocol import StreamOptions

DONE = "data: [DONE]\n\n"
ENGINE_ERRORS = (RequestFailedError, EngineDeadError, EngineOverloadedError)  # what ends a started stream early


def stream_line(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def named_event(obj: dict) -> str:
    """One SSE event named by the object's type (Anthropic's and the Responses API's streams)."""
    return f"event: {obj['type']}\n{stream_line(obj)}"


def error_status(e: Exception) -> int:
    """The HTTP status an engine failure inside a started stream stands for."""
    return e.status if isinstance(e, EngineOverloadedError) else 500


def stream_error(e: Exception) -> str:
    kind = "overloaded" if isinstance(e, EngineOverloadedError) else "internal_server_error"
    return stream_line({"error": {"message": str(e), "type": kind, "param": None, "code": error_status(e)}})


# ---------------------------------------------------------------------- waiting on streams
async def unless_gone(awaitable, gens: list[AsyncIterator], raw: Request):
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
        await close_all(gens)
        raise


async def close_all(gens: list[AsyncIterator]) -> None:
    """Close streams (aborting their requests). One that a just-cancelled task is still inside closes itself when
    that task unwinds; closing it here too would raise "asynchronous generator is already running"."""
    for g in gens:
        if not getattr(g, "ag_running", False):
            await g.aclose()


async def prepend(first, gen: AsyncIterator) -> AsyncIterator:
    """A stream whose first output was already read."""
    try:
        yield first
        if not first.finished:
            async for x in gen:
                yield x
    finally:
        await gen.aclose()


async def first_outputs(gens: list[AsyncIterator], raw: Request, timeout: float | None = None,
                        before: Callable[[int], Awaitable[None]] | None = None) -> list[AsyncIterator]:
    """Wait for every stream's first output, up to ``timeout`` (``before(i)``, when given, is awaited before
    stream i's: fault injection). A client that goes away meanwhile aborts the streams (ClientGone). Returns
    streams that yield those first outputs again."""

    async def first(i: int, g: AsyncIterator):
        if before is not None:
            await before(i)
        return await g.__anext__()

    firsts = await unless_gone(asyncio.wait_for(asyncio.gather(*(first(i, g) for i, g in enumerate(gens))),
                                                timeout=timeout), gens, raw)
    return [prepend(f, g) for f, g in zip(firsts, gens)]


async def final_outputs(gens: list[AsyncIterator], raw: Request) -> list[RequestOutput]:
    """Consume every stream to its end (a client that goes away aborts them all: ClientGone)."""

    async def last(g):
        out = None
        async for out in g:
            pass
        return out

    return await unless_gone(asyncio.gather(*(last(g) for g in gens)), gens, raw)


async def merged(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the outputs of several streams as they come: (prompt index, output)."""
    if len(gens) == 1:  # one prompt: its stream read directly (no pump task and second queue per token)
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await close_all(gens)
        return
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
        await close_all(gens)


def usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ---------------------------------------------------------------------- per-choice deltas
@dataclass(frozen=True)
class ChoiceDelta:
    text: str  # what the client has not seen yet
    offset: int  # where that text starts in the choice's text (what earlier chunks sent)
    logprobs: list[TokenLogprobs] | None  # the logprobs not sent yet (None: the request asked for none)
    first: bool  # the choice's first chunk


class ChoiceDeltas:
    """How much text and how many logprobs each choice of a stream has sent, so that a chunk carries only news."""

    def __init__(self) -> None:
        self._text: dict[int, int] = {}
        self._logprobs: dict[int, int] = {}

    def next(self, index: int, shown: str, c: CompletionOutput, first_text: str = "") -> ChoiceDelta | None:
        """Choice ``index``'s news, where ``shown`` is all the text the client may see now (``first_text`` goes
        before the choice's first chunk); None when there is none and the choice has not finished."""
        start = self._text.get(index)
        text = shown[start or 0:]
        if start is None:
            text = first_text + text
        lps = None if c.logprobs is None else c.logprobs[self._logprobs.get(index, 0):]
        if not text and c.finish_reason is None and not lps:
            return None
        self._text[index] = len(shown)
        if lps is not None:
            self._logprobs[index] = len(c.logprobs)
        return ChoiceDelta(text, start or 0, lps, start is None)


# A choice of a chunk: (prompt index, its output, choice index, the choice's output, the stream's deltas) -> dict
# or None
RenderChoice = Callable[[int, RequestOutput, int, CompletionOutput, ChoiceDeltas], "dict | None"]


class Reply:
    """One response: its id, creation time and the model that serves it (also in a header), as one JSON body or
    as an SSE stream of chunks."""

    def __init__(self, id_prefix: str, model: str, sep: str = "-") -> None:
        self.id = f"{id_prefix}{sep}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.headers = {"x-pagedllm-served-by": model}

    def body(self, obj: str, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def json(self, obj: str, choices: list[dict], finals: list[RequestOutput],
             extra: dict | None = None) -> JSONResponse:
        return JSONResponse({**self.body(obj, choices, usage(finals)), **(extra or {})}, headers=self.headers)

    def sse(self, obj: str, gens: list[AsyncIterator], n: int, options: StreamOptions | None,
            render: RenderChoice, opening: Sequence[dict] = ()) -> StreamingResponse:
        """Chunks of object ``obj``: the ``opening`` choices, then each output choice that ``render`` draws (prompt
        i's choice j has index i * n + j), the usage chunk if asked for, an error line if the engine fails, and
        ``[DONE]``."""
        include_usage = bool(options and options.include_usage)

        async def lines():
            deltas = ChoiceDeltas()
            finals: dict[int, RequestOutput] = {}
            for choice in opening:
                yield stream_line(self.body(obj, [choice]))
            async for i, o in merged(gens):
                for c in o.outputs:
                    choice = render(i, o, i * n + c.index, c, deltas)
                    if choice is not None:
                        yield stream_line(self.body(obj, [choice]))
                if o.finished:
                    finals[i] = o
            if include_usage:
                yield stream_line(self.body(obj, [], usage(list(finals.values()))))

        return self.stream(lines(), stream_error, DONE)

    def stream(self, events: AsyncIterator[str], on_error: Callable[[Exception], str],
               last: str = "") -> StreamingResponse:
        """An SSE response of ``events``; an engine failure midway ends it with ``on_error``'s event, and ``last``
        (when given) closes the stream either way."""

        async def body():
            try:
                async for line in events:
                    yield line
            except ENGINE_ERRORS as e:
                yield on_error(e)
            finally:
                await events.aclose()  # a client that went away: close the streams (aborting their requests)
            if last:
                yield last

        return StreamingResponse(body(), media_type="text/event-stream", headers=self.headers)
