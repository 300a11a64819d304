"""`/v1/completions`: one or more prompts (text or token ids), n choices each, optionally echoed, streamed or not."""

from __future__ import annotations

from dataclasses import replace

from fastapi import Request

from pagedllm.engine.llm_engine import as_prompt_list
from pagedllm.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import CompletionRequest
from pagedllm.server.serving_base import OpenAIServing, prompt_logprobs_json
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


def echo_logprobs(o: RequestOutput, decode, k: int) -> dict:
    """The prompt tokens' part of an echoed choice's logprobs (legacy OpenAI): the first token has none; each
    other one its logprob and at most ``k`` alternatives."""
    first = decode([o.prompt_token_ids[0]])
    rest = [lp if len(lp.top) <= k else replace(lp, top=lp.top[:k]) for lp in (o.prompt_logprobs or [None])[1:]]
    out = completion_logprobs(rest, len(first))
    head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    return {key: head[key] + out[key] for key in head}


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw: Request):
        model = self.check_generative(req.model)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        prompts = as_prompt_list(req.prompt)
        if not prompts:
            raise APIError(400, "prompt must not be empty", "prompt")
        self.refuse_unsupported(req)
        encoded = [self.engine.encode_prompt(x) for x in prompts]
        # echo with logprobs: the prompt's tokens get logprobs too (OpenAI's legacy completions)
        echo_lps = req.echo and req.logprobs is not None
        params = req.to_sampling_params(req.max_tokens, req.logprobs, req.structured(),
                                        max(req.logprobs, req.prompt_logprobs or 0) if echo_lps else None)
        gens, model = await self.start(lambda eng: [eng.encode_prompt(x) for x in prompts], encoded, params, req,
                                       model, raw)
        reply = Reply("cmpl", model)
        n = req.n
        echo = ([text if text is not None else self.engine.tokenizer.decode(ids) for text, ids in encoded]
                if req.echo else None)

        def logprobs(o: RequestOutput, lps: list[TokenLogprobs], first: bool, offset: int) -> dict:
            """The choice's logprobs; with echo, the first chunk's start with the prompt tokens'."""
            if not (first and echo_lps):
                return completion_logprobs(lps, offset)
            prompt = echo_logprobs(o, self.engine.tokenizer.decode, req.logprobs)
            out = completion_logprobs(lps, prompt["text_offset"][-1] + len(prompt["tokens"][-1]))
            return {k: prompt[k] + out[k] for k in prompt}

        if not req.stream:
            finals = await final_outputs(gens, raw)
            choices = []
            for i, o in enumerate(finals):
                for c in o.outputs:
                    choice = {"index": i * n + c.index, "text": (echo[i] if echo else "") + c.text,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                              "logprobs": logprobs(o, c.logprobs, True, 0) if c.logprobs is not None else None}
                    if req.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = prompt_logprobs_json(o.prompt_logprobs)
                    choices.append(choice)
            return reply.json(OBJECT, choices, finals)

        def render(i: int, o: RequestOutput, index: int, c: CompletionOutput, deltas: ChoiceDeltas) -> dict | None:
            d = deltas.next(index, c.text, c, echo[i] if echo else "")
            if d is None:
                return None
            lps = logprobs(o, d.logprobs, d.first, d.offset) if d.logprobs is not None else None
            return {"index": index, "text": d.text, "logprobs": lps, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}

        return reply.sse(OBJECT, gens, n, req.stream_options, render)
