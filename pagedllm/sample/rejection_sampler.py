"""Speculative-decoding verification (Leviathan et al. 2023; Chen et al. 2023).

A drafted token d at position i is accepted with probability min(1, p_i(d) / q_i(d)); at the first rejection the
token is drawn from normalize(max(p_i - q_i, 0)) instead, and drafting stops there; when every draft is accepted a
bonus token is drawn from p_{k}. The output then follows p exactly, whatever q was. A deterministic proposer (n-gram
lookup, a greedy draft model) has q = one-hot(d): pass ``draft_probs=None``.
"""

from __future__ import annotations

import torch


def rejection_sample(
    target_probs: torch.Tensor,  # (B, K+1, V): p at each draft position, plus the bonus position
    draft_tokens: torch.Tensor,  # (B, K) long, padded beyond num_drafts
    num_drafts: list[int],  # drafts per row (<= K)
    uniforms: torch.Tensor,  # (B, K) in [0, 1)
    noise: torch.Tensor,  # (B, K+1, V) Exp(1) draws, for the recovered/bonus samples
    draft_probs: torch.Tensor | None = None,  # (B, K, V) q; None: one-hot at the drafted token
) -> list[list[int]]:
    b, k1, v = target_probs.shape
    k = k1 - 1
    if k == 0:
        bonus = (target_probs[:, 0] / noise[:, 0]).argmax(dim=-1).tolist()
        return [[t] for t in bonus]
    p_draft = target_probs[:, :k].gather(2, draft_tokens.unsqueeze(-1)).squeeze(-1)  # (B, K)
    if draft_probs is None:
        accept = uniforms < p_draft  # q(d) = 1
        residual = target_probs[:, :k].scatter(2, draft_tokens.unsqueeze(-1), 0.0)
    else:
        q_draft = draft_probs.gather(2, draft_tokens.unsqueeze(-1)).squeeze(-1)
        accept = uniforms * q_draft < p_draft  # u < p/q without dividing by a zero q
        residual = (target_probs[:, :k] - draft_probs).clamp_min(0.0)
    # a residual that is all zero can only follow a (float-noise) rejection where p == q: fall back to p
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs[:, :k], residual)
    recovered = (residual / noise[:, :k]).argmax(dim=-1)  # (B, K): exponential race, normalisation-free
    bonus = (target_probs / noise).argmax(dim=-1)  # (B, K+1): a sample of p at every position
    accept_l, rec_l, bonus_l, drafts_l = accept.tolist(), recovered.tolist(), bonus.tolist(), draft_tokens.tolist()
    out = []
    for row in range(b):
        n = num_drafts[row]
        toks = []
        for i in range(n):
            if accept_l[row][i]:
                toks.append(drafts_l[row][i])
            else:
                toks.append(rec_l[row][i])
                break
        else:
            toks.append(bonus_l[row][n])
        out.append(toks)
    return out
