"""What the sampler needs to know about each row of a step: the runner's per-request state
(``CachedRequestState``) and the batched ``SamplingMetadata`` built from it (temperatures, top-k/p, min-p, seeds,
penalties over the tokens generated so far, logit bias, min_tokens bans, logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.sample.sampler import SamplingMetadata
from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    matcher: object | None = None  # llguidance matcher of a constrained request, fed output_token_ids[from:consumed]
    consumed: int = 0
    grammar_from: int | None = None  # the first output token the grammar constrains (None: not reached yet)
    scanned: int = 0  # a constraint with ``after``: output tokens searched for that text so far
    pool_sum: torch.Tensor | None = None  # mean pooling: the sum of the hidden rows so far; cls: the first row


def build_sampling_metadata(states: list[CachedRequestState], extras: list[list[int]], vocab: int,
                            eos_token_id: int | None, dev: torch.device) -> SamplingMetadata:
    """One row per state; ``extras[i]`` are draft tokens that row i treats as already generated."""
    sps = [st.sampling_params for st in states]
    greedy = [sp.temperature == 0.0 for sp in sps]
    temps = [1.0 if g else sp.temperature for g, sp in zip(greedy, sps)]
    all_greedy = all(greedy)
    top_k = top_p = min_p = None
    if not all_greedy:
        if any(sp.top_k > 0 for sp in sps):
            top_k = torch.tensor([sp.top_k if sp.top_k > 0 else vocab for sp in sps], device=dev)
        if any(sp.top_p < 1.0 for sp in sps):
            top_p = torch.tensor([sp.top_p for sp in sps], dtype=torch.float32, device=dev)
        if any(sp.min_p > 0.0 for sp in sps):
            min_p = torch.tensor([sp.min_p for sp in sps], dtype=torch.float32, device=dev)
    generators = {i: st.generator for i, st in enumerate(states) if st.generator is not None}

    rep = pres = freq = out_toks = prompt_toks = None
    if any(sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty for sp in sps):
        rep = torch.tensor([sp.repetition_penalty for sp in sps], dtype=torch.float32, device=dev)
        pres = torch.tensor([sp.presence_penalty for sp in sps], dtype=torch.float32, device=dev)
        freq = torch.tensor([sp.frequency_penalty for sp in sps], dtype=torch.float32, device=dev)
        out_toks = _pad([st.output_token_ids + ex for st, ex in zip(states, extras)], vocab, dev)
        prompt_toks = _pad([st.prompt_token_ids for st in states], vocab, dev)

    logit_bias = None
    lb = [(i, t, b) for i, sp in enumerate(sps) if sp.logit_bias for t, b in sp.logit_bias.items()]
    if lb:
        rows, toks, vals = zip(*lb)
        logit_bias = (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev),
                      torch.tensor(vals, dtype=torch.float32, device=dev))

    banned = None
    eos = eos_token_id
    ban = []
    for i, (st, sp) in enumerate(zip(states, sps)):
        if len(st.output_token_ids) + len(extras[i]) < sp.min_tokens:
            ids = set(sp.stop_token_ids or [])
            if eos is not None and not sp.ignore_eos:
                ids.add(eos)
            ban.extend((i, t) for t in ids)
    if ban:
        rows, toks = zip(*ban)
        banned = (torch.tensor(rows, device=dev), torch.tensor(toks, device=dev))

    wanted = [sp.logprobs for sp in sps if sp.logprobs is not None]
    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
        greedy=torch.tensor(greedy, device=dev),
        all_greedy=all_greedy,
        top_k=top_k, top_p=top_p, min_p=min_p, generators=generators,
        repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
        output_tokens=out_toks, prompt_tokens=prompt_toks,
        logit_bias=logit_bias, banned=banned,
        max_num_logprobs=max(wanted) if wanted else None,
    )


def _pad(rows: list[list[int]], pad: int, dev: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=dev)
