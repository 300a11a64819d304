"""Batched sampling on the device: penalties, logit bias, temperature, top-k, top-p, min-p, seeds, logprobs.

No per-request loop touches the vocabulary; the only per-request work is drawing the exponential noise of a
seeded request from its own generator, which makes its samples independent of whatever else is in the batch.
Sampling uses the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) draws i with probability p_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # (B,) float; greedy rows hold 1.0
    greedy: torch.Tensor  # (B,) bool
    all_greedy: bool
    top_k: torch.Tensor | None  # (B,) long, vocab size where disabled
    top_p: torch.Tensor | None  # (B,) float
    min_p: torch.Tensor | None  # (B,) float
    generators: dict[int, torch.Generator]  # row -> generator of a seeded request
    # penalties (None when every row has the defaults)
    repetition_penalty: torch.Tensor | None  # (B,)
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    output_tokens: torch.Tensor | None  # (B, Lo) long, padded with vocab size
    prompt_tokens: torch.Tensor | None  # (B, Lp) long, padded with vocab size
    # sparse additions: (rows, token ids, values)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) set to -inf (min_tokens)
    max_num_logprobs: int | None  # None: no row wants logprobs
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, (rows, V) bool): grammar-allowed tokens


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # (B,)
    raw_logprobs: torch.Tensor | None  # (B, V) log-softmax of the raw logits, when any row wants logprobs
    probs: torch.Tensor | None  # (B, V) the processed distribution sampled from (when asked; not for greedy rows)


def _token_counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    counts = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
    vocab = logits.shape[1]
    out_counts = _token_counts(m.output_tokens, vocab)
    if m.repetition_penalty is not None:
        seen = out_counts > 0
        if m.prompt_tokens is not None:
            seen |= _token_counts(m.prompt_tokens, vocab) > 0
        rp = m.repetition_penalty.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalized, logits)
    if m.frequency_penalty is not None:
        logits = logits - m.frequency_penalty.unsqueeze(1) * out_counts
    if m.presence_penalty is not None:
        logits = logits - m.presence_penalty.unsqueeze(1) * (out_counts > 0).float()
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
    if m.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        thresh = probs.amax(dim=-1, keepdim=True) * m.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    if m.top_k is None and m.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if m.top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= m.top_k.unsqueeze(1), float("-inf"))
    if m.top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        drop = before > m.top_p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    def __init__(self, ops=None) -> None:
        """``ops``: the fused CPU kernels (their ``argmax_rows``), or None for torch's reductions."""
        self.ops = ops

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's first maximum, as ``x.max(dim=-1).indices`` (faster than ``argmax`` on CPU; the kernel is
        faster again, single-threaded: docs/history.md#figures-from-code-comments)."""
        if (self.ops is not None and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
                and x.stride(1) == 1):
            return self.ops.argmax_rows(x)
        return x.max(dim=-1).indices

    def __call__(self, logits: torch.Tensor, m: SamplingMetadata, return_probs: bool = False) -> SamplerOutput:
        """logits: (B, V) float32 raw model outputs."""
        raw = logits
        if m.allowed is not None:  # constrained decoding: every token the row's grammar forbids gets -inf
            rows, ok = m.allowed
            logits = logits.index_put((rows,), logits[rows].masked_fill(~ok, float("-inf")))
        if m.banned is not None:
            logits = logits.index_put((m.banned[0], m.banned[1]), torch.tensor(float("-inf"), device=logits.device))
        if m.logit_bias is not None:
            rows, toks, vals = m.logit_bias
            logits = logits.index_put((rows, toks), vals, accumulate=True)
        if m.output_tokens is not None:
            logits = apply_penalties(logits, m)
        greedy_tokens = self.argmax(logits)
        probs = None
        if m.all_greedy:
            tokens = greedy_tokens
        else:
            x = apply_top_k_top_p_min_p(logits / m.temperature.unsqueeze(1), m)
            probs = torch.softmax(x, dim=-1)
            noise = torch.empty_like(probs).exponential_()
            for row, gen in m.generators.items():
                noise[row].exponential_(generator=gen)
            sampled = self.argmax(probs / noise)
            tokens = torch.where(m.greedy, greedy_tokens, sampled)
        raw_lp = torch.log_softmax(raw, dim=-1) if m.max_num_logprobs is not None else None
        return SamplerOutput(tokens, raw_lp, probs if return_probs else None)


def gather_logprobs(raw_lp: torch.Tensor, rows: list[int], tokens: list[int], k: int):
    """Logprob and rank of ``tokens[i]`` in row ``rows[i]``, and each row's top-k: plain lists."""
    dev = raw_lp.device
    lp = raw_lp[torch.tensor(rows, device=dev)]
    chosen = lp.gather(1, torch.tensor(tokens, device=dev).unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen.unsqueeze(1)).sum(dim=-1) + 1
    top_v = top_i = None
    if k > 0:
        top_v, top_i = lp.topk(k, dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    return chosen.tolist(), ranks.tolist(), top_i, top_v
