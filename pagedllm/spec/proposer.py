"""Speculative proposers: after a step, draft up to k tokens for each request that sampled one; the target
verifies them in the next step (``pagedllm.spec.verify``).

- ``NgramProposer``: prompt lookup (``pagedllm.spec.ngram``) over the request's prompt and output;
- ``DraftProposer``: greedy drafts from a small model sharing the target's vocabulary. Its KV cache uses the
  target's block tables and slots (the KV cache holds both models' layers), and it keeps that KV in step by running
  on every token the target computes (``observe``).
- ``MTPProposer``: greedy drafts from the model's own multi-token prediction module (``model.mtp``), which reads
  the target's final hidden states. It runs on every row the target computes once the step's tokens are sampled
  (each row's input is the token after it), keeping its one layer's KV in the same blocks, and its output at a
  request's last accepted row is the first draft; further drafts feed its own output back.

A constrained request keeps only the drafts its grammar accepts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from pagedllm.config import SpeculativeConfig, resolve_model_path
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.model.arch import ModelArchConfig
from pagedllm.model.decoder import CausalLM
from pagedllm.model.loader import load_model_files
from pagedllm.model.mtp import MTPHead
from pagedllm.outputs import ScheduledRequest, SchedulerOutput
from pagedllm.sample.metadata import CachedRequestState
from pagedllm.sample.structured import StructuredOutputs, constrain_drafts
from pagedllm.spec.ngram import propose_ngram


def load_draft_model(path: str, target: ModelArchConfig, max_model_len: int, device: torch.device,
                     dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> CausalLM:
    """The draft model, checked against the target: the same vocabulary, a context of at least ``max_model_len``."""
    darch, dweights = load_model_files(resolve_model_path(path))
    a = target
    if darch.vocab_size != a.vocab_size or (
        darch.vocab_fingerprint and a.vocab_fingerprint and darch.vocab_fingerprint != a.vocab_fingerprint
    ):
        raise ValueError(
            f"the draft model {path} does not share the target's vocabulary (vocab sizes {darch.vocab_size} vs "
            f"{a.vocab_size}): speculative decoding needs the same tokenizer"
        )
    if darch.max_position < max_model_len:
        raise ValueError(f"the draft model's context ({darch.max_position}) is shorter than max_model_len "
                         f"({max_model_len})")
    return CausalLM(darch, dweights, device, dtype, kv_dtype=kv_dtype)


@dataclass
class TargetStep:
    """One forward pass of the target, after its tokens were sampled: what a proposer may read."""

    input_ids: torch.Tensor  # (T,) the rows' tokens, the scheduled requests' one after another
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    hidden: torch.Tensor  # (T, H) final hidden states (after the final norm)
    scheduled: list[ScheduledRequest]  # in row order
    sampled: dict[str, list[int]]  # the tokens each request that sampled accepted this step (drafts, then one more)


class Proposer:
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int) -> None:
        self.cfg = cfg
        self.max_model_len = max_model_len

    def observe(self, step: TargetStep, requests: dict[str, CachedRequestState]) -> None:
        """Called after every forward pass of the target, once its tokens are sampled."""

    def propose(self, so: SchedulerOutput, req_ids: Iterable[str], requests: dict[str, CachedRequestState],
                structured: StructuredOutputs | None = None) -> dict[str, list[int]]:
        """Drafts for ``req_ids`` (the requests that sampled a token this step): at most k each, fitting the
        context; a constrained request keeps only those its grammar accepts."""
        k = self.cfg.num_speculative_tokens
        budget = {}
        for rid in req_ids:
            st = requests[rid]
            n_tok = len(st.prompt_token_ids) + len(st.output_token_ids)
            budget[rid] = min(k, self.max_model_len - n_tok - 1)  # drafts must fit the context
        res = self._drafts(budget, requests, so)
        for rid, drafts in res.items():  # a constrained request keeps only the drafts its grammar accepts
            if structured is not None:
                constrain_drafts(requests[rid], drafts, structured)
        return res

    def _drafts(self, budget: dict[str, int], requests: dict[str, CachedRequestState],
                so: SchedulerOutput) -> dict[str, list[int]]:
        raise NotImplementedError


class NgramProposer(Proposer):
    def _drafts(self, budget, requests, so):
        cfg = self.cfg
        res = {}
        for rid, kk in budget.items():
            if kk > 0:
                st = requests[rid]
                res[rid] = propose_ngram(st.prompt_token_ids + st.output_token_ids, cfg.prompt_lookup_min,
                                         cfg.prompt_lookup_max, kk)
        return res


class _LayersProposer(Proposer):
    """A proposer with layers of its own whose K/V live in the target's blocks (a draft model, an MTP module)."""

    def __init__(self, cfg: SpeculativeConfig, max_model_len: int,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, device: torch.device,
                 decode_metadata: Callable[[list[int], list[list[int]], list[int]], AttentionMetadata]) -> None:
        """``kv_caches``: its layers of the KV cache (the target's blocks); ``decode_metadata(slots, tables,
        lens)``: the runner's attention metadata for a batch of decodes."""
        super().__init__(cfg, max_model_len)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.decode_metadata = decode_metadata

    def _decode_step(self, active: list[str], pos: dict[str, int], tables: dict[str, list[int]]):
        """(token positions, attention metadata) of one decode row per request at ``pos``."""
        bs = self.block_size
        slots = [tables[r][pos[r] // bs] * bs + pos[r] % bs for r in active]
        meta = self.decode_metadata(slots, [tables[r][: pos[r] // bs + 1] for r in active], [pos[r] + 1 for r in active])
        return torch.tensor([pos[r] for r in active], device=self.device), meta


class DraftProposer(_LayersProposer):
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int, model: CausalLM, *args) -> None:
        """``args``: ``_LayersProposer``'s (the draft's KV layers, ...)."""
        super().__init__(cfg, max_model_len, *args)
        self.model = model

    def observe(self, step, requests) -> None:
        # the draft keeps its own KV for every token the target computes (same block tables and slots)
        self.model.forward(step.input_ids, step.positions, self.kv_caches, step.meta)

    def _drafts(self, budget, requests, so):
        return self._propose_draft(budget, requests, {s.req_id: s.block_ids[0] for s in so.scheduled})

    @torch.inference_mode()
    def _propose_draft(self, budget: dict[str, int], requests: dict[str, CachedRequestState],
                       tables: dict[str, list[int]]) -> dict[str, list[int]]:
        """Greedy drafts from the draft model, k decode passes batched over the requests."""
        active = [rid for rid, kk in budget.items() if kk > 0]
        pos = {}
        last = {}
        for rid in active:
            st = requests[rid]
            pos[rid] = len(st.prompt_token_ids) + len(st.output_token_ids) - 1  # the newest token, not in KV yet
            last[rid] = st.output_token_ids[-1]
        res: dict[str, list[int]] = {rid: [] for rid in active}
        while active:
            positions, meta = self._decode_step(active, pos, tables)
            hidden = self.model.forward(torch.tensor([last[r] for r in active], device=self.device), positions,
                                        self.kv_caches, meta)
            nxt = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            still = []
            for r, t in zip(active, nxt):
                res[r].append(t)
                last[r] = t
                pos[r] += 1
                if len(res[r]) < budget[r]:
                    still.append(r)
            active = still
        return res


class MTPProposer(_LayersProposer):
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int, head: MTPHead, *args) -> None:
        """``args``: ``_LayersProposer``'s (the MTP layer's KV, ...)."""
        super().__init__(cfg, max_model_len, *args)
        self.head = head
        # per request that sampled in the last observed step: the module's output at its last accepted row (H,)
        self.last: dict[str, torch.Tensor] = {}

    @staticmethod
    def next_tokens(step: TargetStep, requests: dict[str, CachedRequestState]) -> tuple[list[int], dict[str, int]]:
        """The token after each row's position, where the step knows it: the next row's, a sampled one, or (a
        prompt chunk) the request's next token; and each sampling request's last accepted row. A row after a
        rejected draft gets a placeholder: its KV is written again when the target computes that position."""
        ids = step.input_ids.tolist()
        nxt = ids[1:] + ids[-1:]
        last_rows = {}
        a = 0
        for s in step.scheduled:
            n = len(s.token_ids)
            end = a + n - 1
            new = step.sampled.get(s.req_id)
            if new:  # the sampled rows are the last 1 + drafts: row base + j's next token is new[j]
                base = end - s.num_spec_tokens
                nxt[end] = new[-1]
                nxt[base : base + len(new)] = new
                last_rows[s.req_id] = base + len(new) - 1
            else:  # a chunk: the request's token after it (not known yet: a placeholder, written again then)
                st, q = requests[s.req_id], s.num_computed_tokens + n
                prompt, output = st.prompt_token_ids, st.output_token_ids
                nxt[end] = (prompt[q] if q < len(prompt) else output[q - len(prompt)]
                            if q - len(prompt) < len(output) else ids[end])
            a += n
        return nxt, last_rows

    def observe(self, step, requests) -> None:
        nxt, last_rows = self.next_tokens(step, requests)
        out = self.head.forward(torch.tensor(nxt, device=step.input_ids.device), step.positions, step.hidden,
                                self.kv_caches, step.meta)
        self.last = {rid: out[r] for rid, r in last_rows.items()}

    def _drafts(self, budget, requests, so):
        return self._propose_mtp(budget, requests, {s.req_id: s.block_ids[0] for s in so.scheduled})

    @torch.inference_mode()
    def _propose_mtp(self, budget: dict[str, int], requests: dict[str, CachedRequestState],
                     tables: dict[str, list[int]]) -> dict[str, list[int]]:
        """The first draft from the module's output at each request's last accepted row; each further one from the
        module at the next position (the draft before it as its token, its own output as the hidden state)."""
        active = [rid for rid, kk in budget.items() if kk > 0 and rid in self.last]
        res: dict[str, list[int]] = {rid: [] for rid in active}
        if not active:
            return res
        hidden = torch.stack([self.last[r] for r in active])
        # the newest token's position (the next draft's row: it reads that token's embedding)
        pos = {r: len(requests[r].prompt_token_ids) + len(requests[r].output_token_ids) - 1 for r in active}
        while True:
            drafts = self.head.compute_logits(hidden).argmax(dim=-1).tolist()
            keep = []
            for i, (r, t) in enumerate(zip(active, drafts)):
                res[r].append(t)
                if len(res[r]) < budget[r]:
                    keep.append(i)
            if not keep:
                return res
            active = [active[i] for i in keep]
            hidden = hidden[keep]
            positions, meta = self._decode_step(active, pos, tables)
            hidden = self.head.forward(torch.tensor([res[r][-1] for r in active], device=self.device), positions,
                                       hidden, self.kv_caches, meta)
            for r in active:
                pos[r] += 1
