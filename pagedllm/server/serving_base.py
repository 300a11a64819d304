"""What the two generate endpoints share before their responses differ: the model check, refusing fields pagedllm
does not implement, and starting a request (its prompts queued on the engine the router picks)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi import Request

from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.outputs import TokenLogprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.degradation import FallbackRouter
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import AnthropicCountTokensRequest, ChatCompletionRequest, CompletionRequest
from pagedllm.server.streaming import close_all

# encode(engine) -> the request's prompts tokenized for that engine: [(text or None, token ids)]
EncodeFn = Callable[[AsyncLLM], list[tuple[str | None, list[int]]]]
GenerateRequest = CompletionRequest | ChatCompletionRequest


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_names: list[str], router: FallbackRouter) -> None:
        self.engine = engine
        self.model_names = model_names
        self.router = router

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.model_names:
            return self.model_names[0]
        if self.router.fallback is not None and model == self.router.fallback_name:
            return model
        raise APIError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")

    def engine_for(self, name: str) -> AsyncLLM:
        """The engine serving model ``name`` (a name ``check_model`` returned): the primary, or the fallback."""
        return self.engine if name == self.model_names[0] else self.router.fallback

    def check_generative(self, model: str | None) -> str:
        """``check_model`` for the text routes: an embedding model answers them with a 400 naming its routes."""
        name = self.check_model(model)
        if self.engine_for(name).is_embedding_model:
            raise APIError(400, f"`{name}` is an embedding model: it serves /v1/embeddings, /v1/rerank and /score, "
                                "not text generation", "model")
        return name

    @staticmethod
    def refuse_unsupported(req: GenerateRequest | AnthropicCountTokensRequest) -> None:
        bad = req.unsupported_fields()
        if bad:
            raise APIError(400, f"unsupported field(s) {bad}: pagedllm does not implement "
                                f"{'it' if len(bad) == 1 else 'them'}", bad[0])
        if getattr(req, "prompt_logprobs", None) is not None and req.stream:
            raise APIError(400, "prompt_logprobs is not available with stream=true (as in vLLM)", "prompt_logprobs")

    async def start(self, encode: EncodeFn, encoded: list[tuple[str | None, list[int]]], params: SamplingParams,
                    req: GenerateRequest, model: str, raw: Request) -> tuple[list[AsyncIterator], str]:
        """Queue the request's prompts where the router sends them; returns the streams and who serves them.
        ``encoded``: the prompts already encoded for the primary engine (an encoding error was a 400 before this);
        ``encode`` encodes them for another engine (the fallback's tokenizer)."""

        async def queue(engine: AsyncLLM):
            prompts = encoded if engine is self.engine else encode(engine)
            return await self._queue(engine, prompts, params, req), [text for text, _ in prompts]

        return await self.router.route(model, queue, raw, req.stream)

    @staticmethod
    async def _queue(engine: AsyncLLM, prompts, params: SamplingParams, req: GenerateRequest) -> list[AsyncIterator]:
        """Queue one request per prompt; a bad prompt aborts those already queued and raises."""
        gens = []
        try:
            for text, ids in prompts:
                gens.append(engine.generate(text, ids, params, priority=req.priority,
                                            max_queue_delay_ms=req.max_queue_delay_ms))
        except BaseException:
            await close_all(gens)
            raise
        return gens


def prompt_logprobs_json(lps: list[TokenLogprobs | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first), token id -> logprob, rank and decoded
    text, for the prompt token and its top alternatives."""
    def entry(t) -> dict:
        return {"logprob": t.logprob, "rank": t.rank, "decoded_token": t.decoded_token}

    return [None if lp is None else {str(lp.token_id): entry(lp), **{str(t.token_id): entry(t) for t in lp.top
                                                                      if t.token_id != lp.token_id}}
            for lp in lps]
