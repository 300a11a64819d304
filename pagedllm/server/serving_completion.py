"""`/v1/completions`: one or more prompts (text or token ids), n choices each, optionally echoed, streamed or not."""

from __future__ import annotations

from fastapi import Request

from pagedllm.outputs import CompletionOutput, TokenLogprobs
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import CompletionRequest
from pagedllm.server.serving_base import OpenAIServing
from pagedllm.server.streaming import ChoiceDeltas, Reply, final_outputs

OBJECT = "text_completion"


def completion_logprobs(lps: list[TokenLogprobs], text_offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        tokens.append(lp.decoded_token)
        token_lps.append(lp.logprob)
        tops.append({t.decoded_token: t.logprob for t in lp.top} or None)
        offsets.append(text_offset)
        text_offset += len(lp.decoded_token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw: Request):
        model = self.check_model(req.model)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo together with logprobs (prompt logprobs) is not supported", "echo")
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(t, int) for t in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError(400, "prompt must not be empty", "prompt")
        self.refuse_unsupported(req)
        encoded = [self.engine.encode_prompt(x) for x in prompts]
        params = req.to_sampling_params(req.max_tokens, req.logprobs, req.structured())
        gens, model = await self.start(lambda eng: [eng.encode_prompt(x) for x in prompts], encoded, params, req,
                                       model, raw)
        reply = Reply("cmpl", model)
        n = req.n
        echo = ([text if text is not None else self.engine.tokenizer.decode(ids) for text, ids in encoded]
                if req.echo else None)

        if not req.stream:
            finals = await final_outputs(gens, raw)
            choices = [{"index": i * n + c.index, "text": (echo[i] if echo else "") + c.text,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                        "logprobs": completion_logprobs(c.logprobs, 0) if c.logprobs is not None else None}
                       for i, o in enumerate(finals) for c in o.outputs]
            return reply.json(OBJECT, choices, finals)

        def render(i: int, index: int, c: CompletionOutput, deltas: ChoiceDeltas) -> dict | None:
            d = deltas.next(index, c.text, c, echo[i] if echo else "")
            if d is None:
                return None
            lps = completion_logprobs(d.logprobs, d.offset) if d.logprobs is not None else None
            return {"index": index, "text": d.text, "logprobs": lps, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}

        return reply.sse(OBJECT, gens, n, req.stream_options, render)
