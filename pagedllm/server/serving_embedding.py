"""`/v1/embeddings`: each input's final hidden states pooled into one vector (the last token's, or the mean),
L2-normalised unless asked not to, as floats or base64 float32.

Only the model named serves embeddings: a fallback model's vectors live in another space, so they never stand in
for the primary's (a failure is an error, not a fallback)."""

from __future__ import annotations

import base64
import struct

from fastapi import Request

from pagedllm.engine.llm_engine import as_prompt_list
from pagedllm.outputs import l2_normalize
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import EmbeddingRequest
from pagedllm.server.serving_base import OpenAIServing
from pagedllm.server.streaming import final_outputs


def encode_vector(vec: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, req: EmbeddingRequest, raw: Request) -> dict:
        model = self.check_model(req.model)
        self.refuse_unsupported(req)
        if req.dimensions is not None:
            raise APIError(400, "dimensions is not supported: the vector has the model's hidden size", "dimensions")
        inputs = as_prompt_list(req.input)
        if not inputs:
            raise APIError(400, "input must not be empty", "input")
        engine = self.engine if model == self.model_names[0] else self.router.fallback
        encoded = [engine.encode_prompt(p) for p in inputs]
        if any(not ids for _, ids in encoded):
            raise APIError(400, "input must not contain an empty text or token list", "input")
        params = SamplingParams(max_tokens=1, pooling=req.pooling or engine.default_pooling)
        gens = await self._queue(engine, encoded, params, req)
        finals = await final_outputs(gens, raw)
        data = []
        for i, o in enumerate(finals):
            vec = l2_normalize(o.embedding) if req.normalize else o.embedding
            data.append({"object": "embedding", "index": i, "embedding": encode_vector(vec, req.encoding_format)})
        n = sum(len(o.prompt_token_ids) for o in finals)
        return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": n, "total_tokens": n}}
