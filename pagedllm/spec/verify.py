"""Which tokens each request keeps after the target's sampling pass: its sampled token, or, with k drafts, the
accepted drafts plus one more. Greedy requests accept drafts while they equal the target's argmax; sampled
(temperature > 0) ones go through rejection sampling (``pagedllm.sample.rejection_sampler``), with the drafts
deterministic (one-hot q)."""

from __future__ import annotations

import torch

from pagedllm.sample.metadata import CachedRequestState
from pagedllm.sample.rejection_sampler import rejection_sample


def accept_greedy(groups, tokens: list[int], requests: dict[str, CachedRequestState]) -> dict[str, list[int]]:
    """New tokens of every group without drafts (its sampled token) and of every greedy group with drafts (the
    drafts up to the first that differs from the target's token, then the target's token); sampled groups with
    drafts are left to ``verify_random``."""
    new_tokens: dict[str, list[int]] = {}
    for s, first, n in groups:
        if not s.num_spec_tokens:
            new_tokens[s.req_id] = [tokens[first]]
        elif requests[s.req_id].sampling_params.temperature == 0:
            spec = s.spec_token_ids
            acc = []
            for i, d in enumerate(spec):
                acc.append(tokens[first + i])
                if tokens[first + i] != d:
                    break
            else:
                acc.append(tokens[first + len(spec)])
            new_tokens[s.req_id] = acc
    return new_tokens


def verify_random(groups, probs: torch.Tensor, requests: dict[str, CachedRequestState]) -> dict[str, list[int]]:
    """Rejection sampling for sampled (temperature > 0) requests; drafts are deterministic (one-hot q)."""
    k = max(s.num_spec_tokens for s, _, _ in groups)
    vocab = probs.shape[1]
    dev = probs.device
    p = torch.zeros(len(groups), k + 1, vocab, device=dev)
    drafts = torch.zeros(len(groups), k, dtype=torch.long, device=dev)
    uniforms = torch.empty(len(groups), k, device=dev)
    noise = torch.empty(len(groups), k + 1, vocab, device=dev)
    for j, (s, first, n) in enumerate(groups):
        p[j, :n] = probs[first : first + n]
        spec = s.spec_token_ids
        drafts[j, : len(spec)] = torch.tensor(spec, device=dev)
        gen = requests[s.req_id].generator
        uniforms[j].uniform_(generator=gen)
        noise[j].exponential_(generator=gen)
    toks = rejection_sample(p, drafts, [s.num_spec_tokens for s, _, _ in groups], uniforms, noise)
    return {s.req_id: t for (s, _, _), t in zip(groups, toks)}
