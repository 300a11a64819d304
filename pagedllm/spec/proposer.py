"""Speculative proposers: after a step, draft up to k tokens for each request that sampled one; the target
verifies them in the next step (``pagedllm.spec.verify``).

- ``NgramProposer``: prompt lookup (``pagedllm.spec.ngram``) over the request's prompt and output;
- ``DraftProposer``: greedy drafts from a small model sharing the target's vocabulary. Its KV cache uses the
  target's block tables and slots (the KV cache holds both models' layers), and it keeps that KV in step by running
  on every token the target computes (``observe``).

A constrained request keeps only the drafts its grammar accepts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from pagedllm.config import SpeculativeConfig, resolve_model_path
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.model.arch import ModelArchConfig
from pagedllm.model.decoder import CausalLM
from pagedllm.model.loader import load_model_files
from pagedllm.outputs import SchedulerOutput
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


class Proposer:
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int) -> None:
        self.cfg = cfg
        self.max_model_len = max_model_len

    def observe(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Called with every forward pass of the target (its tokens, positions and attention metadata)."""

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


class DraftProposer(Proposer):
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int, model: CausalLM,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, device: torch.device,
                 decode_metadata: Callable[[list[int], list[list[int]], list[int]], AttentionMetadata]) -> None:
        """``kv_caches``: the draft's layers of the KV cache (the target's blocks); ``decode_metadata(slots,
        tables, lens)``: the runner's attention metadata for a batch of decodes."""
        super().__init__(cfg, max_model_len)
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.decode_metadata = decode_metadata

    def observe(self, input_ids, positions, meta) -> None:
        # the draft keeps its own KV for every token the target computes (same block tables and slots)
        self.model.forward(input_ids, positions, self.kv_caches, meta)

    def _drafts(self, budget, requests, so):
        return self._propose_draft(budget, requests, {s.req_id: s.block_ids[0] for s in so.scheduled})

    @torch.inference_mode()
    def _propose_draft(self, budget: dict[str, int], requests: dict[str, CachedRequestState],
                       tables: dict[str, list[int]]) -> dict[str, list[int]]:
        """Greedy drafts from the draft model, k decode passes batched over the requests."""
        bs = self.block_size
        active = [rid for rid, kk in budget.items() if kk > 0]
        pos = {}
        last = {}
        for rid in active:
            st = requests[rid]
            pos[rid] = len(st.prompt_token_ids) + len(st.output_token_ids) - 1  # the newest token, not in KV yet
            last[rid] = st.output_token_ids[-1]
        res: dict[str, list[int]] = {rid: [] for rid in active}
        while active:
            dev = self.device
            slots = [tables[r][pos[r] // bs] * bs + pos[r] % bs for r in active]
            dec_tables = [tables[r][: pos[r] // bs + 1] for r in active]
            meta = self.decode_metadata(slots, dec_tables, [pos[r] + 1 for r in active])
            hidden = self.model.forward(
                torch.tensor([last[r] for r in active], device=dev), torch.tensor([pos[r] for r in active], device=dev),
                self.kv_caches, meta,
            )
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
