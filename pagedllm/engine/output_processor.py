"""Front-end request handling: prompts -> core ``Request``s, and core outputs -> detokenized ``RequestOutput``s.

Stop strings are found here, on the text: the returned text excludes the stop string (unless asked), and the
core is told to abort the request so its blocks are freed at once. A request with ``n`` > 1 becomes ``n`` core
requests (children) whose outputs are gathered into one ``RequestOutput``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    FinishedRequestStats,
    IterationStats,
    Logprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from pagedllm.request import FinishReason, Request
from pagedllm.sampling_params import SamplingParams


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


@dataclass
class ChildState:
    parent: "ParentState"
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None
    queue_time: float = 0.0
    embedding: list[float] | None = None

    def visible_text(self) -> str:
        """While running, hold back a tail that could still become a stop string."""
        text = self.detok.text
        if self.finish_reason is None and self.params.stop_strings:
            hold = max(len(s) for s in self.params.stop_strings) - 1
            return text[: max(len(text) - hold, 0)]
        return text


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[ChildState]
    arrival_time: float
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    def to_output(self) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=c.index, text=c.visible_text(), token_ids=list(c.token_ids), finish_reason=c.finish_reason,
                stop_reason=c.stop_reason, logprobs=list(c.logprobs) if c.logprobs is not None else None,
            )
            for c in self.children
        ]
        last = max((c.last_token_time for c in self.children if c.last_token_time is not None), default=None)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             self.num_cached_tokens, RequestMetrics(self.arrival_time, self.first_token_time, last),
                             self.prompt_logprobs, self.children[0].embedding)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_id: int | None, max_model_len: int,
                 model_stop_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.special_ids = frozenset(tokenizer.all_special_ids)  # (each detokenizer's, read once)
        self.eos_token_id = eos_token_id
        # the model's other end-of-generation tokens (gemma's <end_of_turn>): they stop a request as eos does
        self.model_stop_ids = tuple(t for t in model_stop_ids if t != eos_token_id)
        self.max_model_len = max_model_len
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, ChildState] = {}
        self._aborted: list[FinishedRequestStats] = []  # reported with the next step's statistics

    # ------------------------------------------------------------------ in
    def make_requests(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        priority: int = 0, arrival_time: float | None = None,
    ) -> tuple[ParentState, list[Request]]:
        """Build the core requests of one user request (n children) from a prompt the engine core has checked
        (``EngineCore.check_prompt_token_ids``). Nothing is stored yet."""
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        n_prompt = len(prompt_token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        arrival = time.monotonic() if arrival_time is None else arrival_time
        parent = ParentState(request_id, prompt, list(prompt_token_ids), [], arrival)
        reqs = []
        if self.model_stop_ids and not params.ignore_eos and params.pooling is None:  # (a pooled one samples none)
            params = replace(params, stop_token_ids=sorted(set(params.stop_token_ids or ()) | set(self.model_stop_ids)))
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            rid = child_request_id(request_id, i, params.n)
            reqs.append(Request(rid, prompt_token_ids, child_params, self.eos_token_id, max_tokens, arrival, priority))
            parent.children.append(ChildState(
                parent, i, child_params,
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens, self.special_ids),
                logprobs=[] if params.logprobs is not None else None,
            ))
        return parent, reqs

    def register(self, parent: ParentState, reqs: list[Request]) -> None:
        """Track a request once the core has accepted its children."""
        self.parents[parent.request_id] = parent
        for req, child in zip(reqs, parent.children):
            self.children[req.request_id] = child

    # ------------------------------------------------------------------ out
    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str], IterationStats]:
        """Apply core outputs. Returns the changed requests' outputs, child ids the core must abort, and the
        step's statistics."""
        changed: dict[str, ParentState] = {}
        to_abort: list[str] = []
        stats = IterationStats(finished=self._aborted)
        self._aborted = []
        now = time.monotonic()
        for o in outputs:
            child = self.children.get(o.req_id)
            if child is None:
                continue
            parent = child.parent
            parent.num_cached_tokens = max(parent.num_cached_tokens, o.num_cached_tokens)
            if parent.first_token_time is None and (o.new_token_ids or o.pooled is not None):
                parent.first_token_time = now
            if o.prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = [None] + [self._convert_logprobs(lp) for lp in o.prompt_logprobs]
            if o.pooled is not None:
                child.embedding = o.pooled
                stats.num_prompt_tokens += len(parent.prompt_token_ids)
            if o.queue_time is not None:
                child.queue_time = o.queue_time
            if o.new_token_ids:
                stats.num_generation_tokens += len(o.new_token_ids)
                if child.last_token_time is None:
                    stats.time_to_first_tokens.append(now - parent.arrival_time)
                    stats.num_prompt_tokens += len(parent.prompt_token_ids)
                else:
                    stats.inter_token_latencies.append(now - child.last_token_time)
                child.last_token_time = now
            # the token that stopped the request (eos, a stop token id) is not in the text unless asked for (vLLM's
            # rule; a special token is skipped anyway, but not where skip_special_tokens is off)
            stopped_by = (len(o.new_token_ids) - 1 if o.finish_reason == FinishReason.STOP
                          and not isinstance(o.stop_reason, str) and not child.params.include_stop_str_in_output
                          else -1)
            for i, tok in enumerate(o.new_token_ids):
                child.token_ids.append(tok)
                prev_len = len(child.detok.text)
                if i != stopped_by:
                    child.detok.add_token(tok)
                if o.new_logprobs is not None and child.logprobs is not None:
                    child.logprobs.append(self._convert_logprobs(o.new_logprobs[i]))
                if child.params.stop_strings and self._check_stop_strings(child, prev_len):
                    if o.finish_reason is None:
                        to_abort.append(o.req_id)
                    break
            if child.finish_reason is None and o.finish_reason is not None:
                child.finish_reason = o.finish_reason
                child.stop_reason = o.stop_reason
            if child.finish_reason is not None:
                del self.children[o.req_id]
                stats.finished.append(FinishedRequestStats(
                    child.finish_reason, now - parent.arrival_time, child.queue_time,
                    len(parent.prompt_token_ids), len(child.token_ids),
                ))
            changed[parent.request_id] = parent
        results = []
        for rid, parent in changed.items():
            results.append(parent.to_output())
            if parent.finished:
                del self.parents[rid]
        return results, to_abort, stats

    def abort(self, request_id: str) -> tuple[RequestOutput | None, list[str]]:
        """Mark a user request aborted; returns its final output and the child ids to abort in the core."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None, []
        ids = []
        now = time.monotonic()
        for c in parent.children:
            if c.finish_reason is None:
                c.finish_reason = FinishReason.ABORT
                ids.append(child_request_id(request_id, c.index, len(parent.children)))
                self.children.pop(ids[-1], None)
                self._aborted.append(FinishedRequestStats(
                    FinishReason.ABORT, now - parent.arrival_time, c.queue_time, len(parent.prompt_token_ids), len(c.token_ids)
                ))
        return parent.to_output(), ids

    def _check_stop_strings(self, child: ChildState, prev_len: int) -> bool:
        text = child.detok.text
        for stop in child.params.stop_strings:
            idx = text.find(stop, max(prev_len - len(stop) + 1, 0))
            if idx >= 0:
                end = idx + len(stop) if child.params.include_stop_str_in_output else idx
                child.detok.text = text[:end]
                child.finish_reason = FinishReason.STOP
                child.stop_reason = stop
                return True
        return False

    def _convert_logprobs(self, lp) -> TokenLogprobs:
        dec = self.tokenizer.decode
        return TokenLogprobs(
            token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, decoded_token=dec([lp.token_id]),
            top=[Logprob(t, v, r + 1, dec([t])) for r, (t, v) in enumerate(lp.top)],
        )

    def drain_aborted_stats(self) -> IterationStats:
        """Statistics of aborts not yet reported (when no step runs to carry them)."""
        stats = IterationStats(finished=self._aborted)
        self._aborted = []
        return stats
