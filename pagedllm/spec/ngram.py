"""N-gram (prompt lookup) proposer: find the most recent earlier occurrence of the request's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed it."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    n_tok = len(tokens)
    if n_tok < min_n + 1 or k < 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        pattern = arr[-n:]
        windows = sliding_window_view(arr[:-1], n)  # every earlier n-gram (the suffix itself excluded)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # most recent match
            return arr[start : start + k].tolist()
    return []
