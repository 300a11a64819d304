"""`/v1/embeddings`, `/v1/rerank` and `/score`: each input's final hidden states pooled into one vector (an
embedding model's own pooling and Dense layers, else the last token's or the mean), cut to ``dimensions`` where
the model was trained for it (Matryoshka), L2-normalised as the model's Normalize module does (or as asked); as
floats or base64 float32. Rerank and score compare the normalised vectors of two texts by their cosine.

Only the model named serves embeddings: a fallback model's vectors live in another space, so they never stand in
for the primary's (a failure is an error, not a fallback)."""

from __future__ import annotations

import base64
import functools
import math
import struct
import time
import uuid

import msgspec
from fastapi import Request
from fastapi.responses import Response

from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.llm_engine import as_prompt_list
from pagedllm.outputs import l2_normalize
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from pagedllm.server.serving_base import OpenAIServing
from pagedllm.server.streaming import final_outputs


def encode_vector(vec: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")


def _cosine(a: list[float], b: list[float]) -> float:
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    return sum(x * y for x, y in zip(a, b)) / (na * nb) if na > 0 and nb > 0 else 0.0


@functools.lru_cache(maxsize=None)
def _pooling_params(pooling: str) -> SamplingParams:
    """An embedding request's parameters (frozen: one per pooling, not validated again for every request)."""
    return SamplingParams(max_tokens=1, pooling=pooling)


class OpenAIServingEmbedding(OpenAIServing):
    async def _embed(self, engine: AsyncLLM, inputs: list, req, raw: Request, prompt_name: str | None = None,
                     pooling: str | None = None) -> tuple[list[list[float]], int]:
        """The inputs' vectors (pooled, through the model's Dense layers; not normalised) and their token count."""
        encoded = [engine.encode_for_embedding(p, prompt_name, req.truncate_prompt_tokens) for p in inputs]
        if any(not ids for _, ids in encoded):
            raise APIError(400, "input must not contain an empty text or token list", "input")
        params = _pooling_params(pooling or engine.default_pooling)
        finals = await final_outputs(await self._queue(engine, encoded, params, req), raw)
        return [o.embedding for o in finals], sum(len(o.prompt_token_ids) for o in finals)

    @staticmethod
    def _normalizes(engine: AsyncLLM) -> bool:
        """An embedding model's default: its Normalize module (sentence-transformers'); any other model: yes."""
        return engine.sentence.normalize if engine.sentence is not None else True

    async def create_embedding(self, req: EmbeddingRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        self.refuse_unsupported(req)
        engine = self.engine_for(model)
        dims = engine.sentence.matryoshka_dimensions if engine.sentence is not None else ()
        if req.dimensions is not None and not dims:
            raise APIError(400, "dimensions is not supported: this model was not trained for shorter vectors "
                                "(Matryoshka)", "dimensions")
        inputs = as_prompt_list(req.input)
        if not inputs:
            raise APIError(400, "input must not be empty", "input")
        vectors, n = await self._embed(engine, inputs, req, raw, req.prompt_name, req.pooling)
        if req.dimensions is not None and not 1 <= req.dimensions <= len(vectors[0]):
            raise APIError(400, f"dimensions must be between 1 and {len(vectors[0])} (trained sizes: "
                                f"{', '.join(map(str, dims))})", "dimensions")
        normalize = self._normalizes(engine) if req.normalize is None else req.normalize
        data = []
        for i, vec in enumerate(vectors):
            vec = vec[: req.dimensions] if req.dimensions else vec  # a Matryoshka prefix, normalised again
            vec = l2_normalize(vec) if normalize else vec
            data.append({"object": "embedding", "index": i, "embedding": encode_vector(vec, req.encoding_format)})
        if not all(math.isfinite(x) for vec in vectors for x in vec):  # (JSON has no NaN: msgspec would write null)
            raise APIError(500, "the model produced a non-finite vector")
        body = {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": n, "total_tokens": n}}
        # encoded here in one call: FastAPI's walk over every float of every vector (jsonable_encoder, then json)
        # took ~1/4 of the event loop's time per request under 32 clients of a small model
        return Response(msgspec.json.encode(body), media_type="application/json")

    def _scoring_engine(self, req) -> tuple[str, AsyncLLM]:
        model = self.check_model(req.model)
        self.refuse_unsupported(req)
        engine = self.engine_for(model)
        if not engine.is_embedding_model:
            raise APIError(400, "scores come from an embedding model: this model is a generative one (serve an "
                                "embedding model, e.g. `pagedllm fetch all-minilm-l6-v2`)", "model")
        return model, engine

    @staticmethod
    def _prompt(engine: AsyncLLM, name: str) -> str | None:
        """The model's prompt for queries or documents, where it declares one (EmbeddingGemma)."""
        return name if engine.sentence is not None and name in engine.sentence.prompts else None

    async def rerank(self, req: RerankRequest, raw: Request) -> dict:
        model, engine = self._scoring_engine(req)
        docs = [d if isinstance(d, str) else d.get("text") for d in req.documents]
        if any(not isinstance(d, str) for d in docs):
            raise APIError(400, "each document must be a string or an object with a text field", "documents")
        (q,), nq = await self._embed(engine, [req.query], req, raw, self._prompt(engine, "query"))
        vecs, nd = await self._embed(engine, docs, req, raw, self._prompt(engine, "document"))
        results = sorted(({"index": i, "relevance_score": _cosine(q, v)} | (
            {"document": {"text": docs[i]}} if req.return_documents else {}) for i, v in enumerate(vecs)),
            key=lambda r: -r["relevance_score"])
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": nq + nd},
                "results": results[: req.top_n or len(results)]}

    async def score(self, req: ScoreRequest, raw: Request) -> dict:
        model, engine = self._scoring_engine(req)
        first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        if not first or not second:
            raise APIError(400, "text_1 and text_2 must not be empty", "text_1" if not first else "text_2")
        if len(first) != 1 and len(first) != len(second):
            raise APIError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as "
                                "many as text_2", "text_1")
        a, na = await self._embed(engine, first, req, raw, self._prompt(engine, "query"))
        b, nb = await self._embed(engine, second, req, raw, self._prompt(engine, "document"))
        a = a * len(b) if len(a) == 1 else a
        data = [{"index": i, "object": "score", "score": _cosine(x, y)} for i, (x, y) in enumerate(zip(a, b))]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": {"prompt_tokens": na + nb, "total_tokens": na + nb}}
