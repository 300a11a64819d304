"""The rejection sampler's output follows the target distribution exactly (chi-square on synthetic p, q)."""

import torch

from pagedllm.sample.rejection_sampler import rejection_sample

V = 6
N = 40000
CHI2_CRIT_DF5_P001 = 20.515  # chi-square critical value, 5 degrees of freedom, p = 0.001


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def run(sampler, p, q, one_hot: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = q.shape[0]
    if one_hot:
        drafts = torch.full((N, k), 2, dtype=torch.long)  # a deterministic proposer always drafts token 2
        qq = None
    else:
        drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(k)], dim=1)
        qq = q.expand(N, k, V)
    u = torch.rand(N, k, generator=g)
    noise = torch.empty(N, k + 1, V).exponential_(generator=g)
    return sampler(p.expand(N, k + 1, V), drafts, [k] * N, u, noise, qq)


P = torch.tensor([[0.05, 0.30, 0.10, 0.25, 0.20, 0.10],
                  [0.40, 0.05, 0.05, 0.20, 0.10, 0.20],
                  [0.10, 0.10, 0.30, 0.10, 0.30, 0.10]])
Q = torch.tensor([[0.30, 0.05, 0.30, 0.05, 0.20, 0.10],
                  [0.10, 0.40, 0.10, 0.10, 0.10, 0.20]])


def distributions(outs):
    first = torch.zeros(V)
    second = torch.zeros(V)
    for toks in outs:
        first[toks[0]] += 1
        if len(toks) > 1:
            second[toks[1]] += 1
    return first, second


def test_output_follows_target_with_draft_probs():
    first, second = distributions(run(rejection_sample, P, Q, one_hot=False))
    assert chi2(first, P[0]) < CHI2_CRIT_DF5_P001
    assert chi2(second, P[1]) < CHI2_CRIT_DF5_P001  # the token after an accepted first draft


def test_output_follows_target_with_one_hot_drafts():
    first, second = distributions(run(rejection_sample, P, Q, one_hot=True))
    assert chi2(first, P[0]) < CHI2_CRIT_DF5_P001
    assert chi2(second, P[1]) < CHI2_CRIT_DF5_P001
    assert first[2] / N > 0.05  # drafted token 2 was accepted about p(2) of the time


def wrong_sampler(target_probs, draft_tokens, num_drafts, uniforms, noise, draft_probs=None):
    """Resamples rejected positions from p instead of the residual max(p - q, 0): biased."""
    k = draft_tokens.shape[1]
    q_draft = draft_probs.gather(2, draft_tokens.unsqueeze(-1)).squeeze(-1)
    p_draft = target_probs[:, :k].gather(2, draft_tokens.unsqueeze(-1)).squeeze(-1)
    accept = (uniforms * q_draft < p_draft).tolist()
    rec = (target_probs[:, :k] / noise[:, :k]).argmax(-1).tolist()
    out = []
    for r in range(len(num_drafts)):
        out.append([draft_tokens[r, 0].item()] if accept[r][0] else [rec[r][0]])
    return out


def test_chi_square_catches_a_wrong_sampler():
    first, _ = distributions(run(wrong_sampler, P, Q, one_hot=False))
    assert chi2(first, P[0]) > CHI2_CRIT_DF5_P001


def test_greedy_like_target_accepts_only_argmax():
    p = torch.zeros(3, V)
    p[:, 4] = 1.0
    outs = rejection_sample(p.expand(5, 3, V), torch.tensor([[4, 1]] * 5), [2] * 5, torch.rand(5, 2),
                            torch.empty(5, 3, V).exponential_())
    assert outs == [[4, 4]] * 5  # first draft accepted, second rejected and replaced by the target's token
