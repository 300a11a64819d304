"""SLA mode: choose each step's token budget, and a cap on the prefills it starts, from latency targets.

Step-time model. A step's duration is modelled as ``a + b * tokens + c * seqs + d * context``: ``tokens`` are all
tokens computed in the step (prefill chunks, decodes, drafts), ``seqs`` the sequences in it (each has its own
sampling and attention overhead), ``context`` the KV tokens those sequences attend over (the sum of their context
lengths: the KV-gather cost that grows with the number of running sequences and how long they are). The four
coefficients are fitted online by exponentially weighted least squares (forgetting factor 0.98, kept
non-negative; the first step, which pays for lazy initialisation, is skipped, and samples far off the fit are
damped) from the step times the engine measures (schedule + forward pass + bookkeeping).

Plan. Before each step the scheduler gives the controller the decoding sequences (how many, their tokens and
context) and the prefill queue in scheduling order: the unfinished prefill chunks of running requests, then the
waiting requests, each with the tokens it still has to compute and how long it has waited. For candidate amounts
of prefill work (whole prompts from the head of the queue, halvings of the largest amount, the most that fits each
TPOT limit below) it predicts

- this step's duration: every decoding request waits one step per output token, so it is their TPOT;
- the worst TTFT in the queue: each request's age plus the steps until its prefill is done, assuming the same
  prefill allowance per step, each step also paying the fixed and per-decode costs (which grow as finished
  prefills join the decodes). A small budget that chunks prompts over many steps is seen to be slow.

Choice. TPOT is a mean over a request's inter-token gaps, so short recent steps leave room for a longer one: the
TPOT limit on a step is the longest that keeps the mean of the last ``w`` measured steps (this one included) under
the target times ``tpot_margin`` (never below that product itself). With ``g`` the fewest gaps a running request
will have (``max_tokens - 1``; at most 32):

1. Among the candidates under the limit for ``w = g / 2`` (every request's gaps span two such windows), the one
   with the lowest predicted worst TTFT. With only a TTFT target (or nothing decoding) every candidate qualifies.
2. If that still misses the TTFT target (times ``ttft_margin``), or no candidate fits: the limit for ``w = g``, and
   the least prefill work that meets the TTFT target under it (else the fastest under it).
3. If even that is out of reach (the decodes alone are too slow: TPOT cannot hold this step whatever the budget),
   prefills are not held back for it: the least work meeting the TTFT target, else the fastest (with no TTFT
   target, the floor).

The step budget is the decode tokens plus the chosen prefill tokens (never under ``min_budget``); the cap on new
prefills is the number of waiting requests the choice starts (at least one), so prompts that turn out cheaper
(prefix-cache hits) do not start extra sequences. Until a few steps are measured the budget is the maximum; under
a TPOT limit a step grows at most twofold past the largest one measured, so an untried size (whose cost the fit
only extrapolates) is approached gradually. Pure Python.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedllm.config import SchedulerConfig

_SCALE = (1.0, 256.0, 16.0, 4096.0)  # features (1, tokens, seqs, context) are divided by these: O(1) in the fit


@dataclass(frozen=True)
class QueuedPrefill:
    """A prefill waiting for its next chunk, in scheduling order."""

    tokens: int  # still to compute
    age_s: float  # seconds since arrival (since now for a preempted request that had its first token already)
    context: int = 0  # tokens already computed (a running chunked prefill, a swapped-out request)
    new: bool = True  # a waiting request: starting it counts against the cap on new prefills


class BudgetController:
    def __init__(self, max_budget: int, min_budget: int = 16, target_tpot_s: float | None = None,
                 target_ttft_s: float | None = None, forget: float = 0.98, tpot_margin: float = 0.9,
                 ttft_margin: float = 0.8, horizon: int = 32, warmup_steps: int = 4) -> None:
        if target_tpot_s is None and target_ttft_s is None:
            raise ValueError("BudgetController needs a TPOT or a TTFT target")
        self.max_budget = max_budget
        self.min_budget = min(min_budget, max_budget)
        self.target_tpot_s = target_tpot_s
        self.target_ttft_s = target_ttft_s
        self.forget = forget
        self.tpot_margin = tpot_margin
        self.ttft_margin = ttft_margin
        self.horizon = horizon  # queued requests looked at when planning
        self.warmup_steps = warmup_steps  # steps observed before the model is trusted (until then: max budget)
        self._A = [[0.0] * 4 for _ in range(4)]  # weighted sums of x x^T and x y (x: scaled features)
        self._r = [0.0] * 4
        self._theta = [0.0] * 4
        self._n = 0
        self._seen_first = False
        self._largest = 0  # the most tokens in one measured step: the fit is not trusted much beyond it
        self._recent: deque[float] = deque(maxlen=64)  # the last measured step times
        self.current = max_budget
        self.max_new_prefills: int | None = None  # None: no cap

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> "BudgetController | None":
        """The engine's controller for the config's TTFT/TPOT targets (millisecond); None without targets."""
        if not config.sla_mode:
            return None
        budget = config.max_num_batched_tokens
        if budget is None:
            raise ValueError("the step budget is unset: take SchedulerConfig.with_budget_for(max_model_len)")
        return cls(budget, min_budget=min(config.max_num_seqs + 16, budget),
                   target_tpot_s=config.target_tpot_ms / 1000 if config.target_tpot_ms else None,
                   target_ttft_s=config.target_ttft_ms / 1000 if config.target_ttft_ms else None)

    # ------------------------------------------------------------------ the step-time model
    def observe(self, num_tokens: int, step_time_s: float, num_seqs: int = 1, context_tokens: int = 0) -> None:
        """One measured step: its tokens, sequences, attended context, and duration."""
        if num_tokens <= 0 or step_time_s <= 0:
            return
        self._recent.append(step_time_s)
        if not self._seen_first:  # the engine's first step pays for lazy initialisation: not a sample
            self._seen_first = True
            return
        x = (1.0, num_tokens / _SCALE[1], num_seqs / _SCALE[2], context_tokens / _SCALE[3])
        w = 1.0
        if self._n >= 2 * self.warmup_steps:  # damp samples far off the model (a pause, a warm-up step)
            pred = sum(t * xi for t, xi in zip(self._theta, x))
            if pred > 0:
                ratio = step_time_s / pred
                if ratio > 3.0:
                    w = 3.0 / ratio
                elif ratio < 1 / 3:
                    w = 3.0 * ratio
        lam, A, r = self.forget, self._A, self._r
        for i in range(4):
            r[i] = lam * r[i] + w * x[i] * step_time_s
            for j in range(4):
                A[i][j] = lam * A[i][j] + w * x[i] * x[j]
        self._n += 1
        self._largest = max(self._largest, num_tokens)
        self._theta = self._fit()

    def _fit(self) -> list[float]:
        """Non-negative ridge least squares on the weighted sums (drop the most negative term until none is)."""
        ridge = 1e-4 * self._A[0][0] + 1e-12
        active = [0, 1, 2, 3]
        while True:
            m = [[self._A[i][j] + (ridge if i == j else 0.0) for j in active] + [self._r[i]] for i in active]
            sol = _solve(m)
            theta = [0.0] * 4
            for k, i in enumerate(active):
                theta[i] = sol[k]
            neg = min(active, key=lambda i: theta[i])
            if theta[neg] >= 0 or len(active) == 1:
                return [max(t, 0.0) for t in theta]
            active.remove(neg)

    def coefficients(self) -> tuple[float, float, float, float]:
        """(a, b, c, d): seconds per step, per token, per sequence, per context token."""
        return tuple(t / s for t, s in zip(self._theta, _SCALE))  # type: ignore[return-value]

    def predict(self, tokens: int, seqs: int = 1, context: int = 0) -> float:
        a, b, c, d = self.coefficients()
        return a + b * tokens + c * seqs + d * context

    # ------------------------------------------------------------------ the plan for one step
    def plan(self, num_decodes: int, decode_tokens: int, decode_context: int,
             queue: list[QueuedPrefill], min_decode_gaps: int | None = None) -> int:
        """Choose this step's token budget (returned, also ``current``) and ``max_new_prefills``.

        ``min_decode_gaps``: the fewest inter-token gaps (output tokens - 1) a decoding request will have; TPOT is
        averaged over them, so it sizes the window over which short steps leave room for a longer one."""
        if self._n < self.warmup_steps:
            self.current, self.max_new_prefills = self.max_budget, None
            return self.current
        a, b, c, d = self.coefficients()
        t0 = a + b * decode_tokens + c * num_decodes + d * decode_context  # the decodes alone
        room = self.max_budget - decode_tokens
        lo = max(self.min_budget - decode_tokens, 1)  # the floor always leaves this much for prefills
        tpot = self.target_tpot_s * self.tpot_margin if self.target_tpot_s and num_decodes else None
        if tpot is not None:  # under a TPOT limit, grow steps at most twofold past the largest one measured
            room = min(room, max(2 * self._largest - decode_tokens, lo))
        queue = queue[: self.horizon]
        total = sum(q.tokens for q in queue)
        if not queue or room <= 0:  # nothing to plan: report what a prefill could get now
            p = room
            if tpot is not None and b + d > 0:
                p = min(room, max(int((tpot - t0 - c) / (b + d)), 0))
            self._set(decode_tokens + p, None)
            return self.current
        hi = max(min(total, room), min(lo, room))
        cands = {hi, min(lo, hi)}
        cum = 0
        for q in queue[:16]:  # whole prompts from the head of the queue
            cum += q.tokens
            if cum >= hi:
                break
            if cum >= lo:
                cands.add(cum)
        p = hi
        while p > lo:
            cands.add(p)
            p //= 2
        limits = None  # (usual, stretched) longest step that keeps TPOT
        if tpot is not None:
            gaps = 8 if min_decode_gaps is None else min_decode_gaps
            limits = (self._allowance(tpot, max(gaps // 2, 1)), self._allowance(tpot, gaps))
            for limit in limits:  # the most prefill work under each limit
                if self._step_time(lo, queue, t0, b, c, d) <= limit < self._step_time(hi, queue, t0, b, c, d):
                    ok_p, over_p = lo, hi
                    while over_p - ok_p > 1:
                        mid = (ok_p + over_p) // 2
                        if self._step_time(mid, queue, t0, b, c, d) <= limit:
                            ok_p = mid
                        else:
                            over_p = mid
                    cands.add(ok_p)
        evals = [self._evaluate(p, queue, t0, a, b, c, d) for p in sorted(cands)]  # (step s, worst TTFT s, p, new)
        ttft = self.target_ttft_s * self.ttft_margin if self.target_ttft_s else None

        def fastest(es):  # the lowest predicted worst TTFT
            return min(es, key=lambda e: (e[1], e[2]))

        def least_meeting(es):  # the least prefill work that meets the TTFT target, else the fastest
            meets = [e for e in es if ttft is not None and e[1] <= ttft]
            return meets[0] if meets else fastest(es)

        if tpot is None:
            best = fastest(evals)
        else:
            ok = [e for e in evals if e[0] <= limits[0]]
            best = fastest(ok) if ok else None
            if best is None or (ttft is not None and best[1] > ttft):
                # TTFT would miss, or the decodes alone break TPOT: spend the room recent short steps left
                ok = [e for e in evals if e[0] <= limits[1]]
                if ok:
                    best = least_meeting(ok)
                else:  # the TPOT target is out of reach this step: do not hold prefills back for it
                    best = least_meeting(evals) if ttft is not None else evals[0]
        self._set(decode_tokens + best[2], max(best[3], 1))
        return self.current

    def _allowance(self, limit: float, window: int) -> float:
        """The longest step that keeps the mean of the last ``window`` steps (this one included) under ``limit``."""
        w = max(1, min(window, 32))
        recent = list(self._recent)[-(w - 1):] if w > 1 else []
        return max(limit, w * limit - sum(recent) - (w - 1 - len(recent)) * limit)

    def budget(self) -> int:
        """The budget last chosen (the stats line reports it)."""
        return self.current

    def _set(self, budget: int, max_new: int | None) -> None:
        self.current = max(self.min_budget, min(self.max_budget, budget))
        self.max_new_prefills = max_new

    @staticmethod
    def _step_time(p: int, queue: list[QueuedPrefill], t0: float, b: float, c: float, d: float) -> float:
        """Predicted duration of this step when it gives ``p`` tokens to the queue's prefills."""
        t, start = t0, 0
        for q in queue:
            if start >= p:
                break
            n = min(q.tokens, p - start)
            t += b * n + c + d * (q.context + n)
            start += q.tokens
        return t

    @staticmethod
    def _evaluate(p: int, queue: list[QueuedPrefill], t0: float, a: float, b: float, c: float,
                  d: float) -> tuple[float, float, int, int]:
        """Predicted (this step's duration, worst TTFT in the queue, p, new prefills started) when every step
        gives ``p`` tokens to prefills, in queue order."""
        total = sum(q.tokens for q in queue)
        end = 0
        touches = 0  # sequence-steps of prefill chunks so far
        ctx = 0.0  # context attended by those chunks
        joined, joined_k = 0.0, 0.0  # per-step cost of finished prefills now decoding, and its sum times their step
        pend_g, pend_k = 0.0, 0  # finished in the step being looked at (they decode from the next one)
        step1 = BudgetController._step_time(p, queue, t0, b, c, d)
        new1 = 0
        worst = 0.0
        for i, q in enumerate(queue):
            start = end
            end += q.tokens
            first = start // p + 1  # steps are 1-based
            k = -(-end // p)
            span = k - first + 1
            if first == 1:
                new1 += q.new
            touches += span
            ctx += span * (q.context + q.tokens)
            if k > pend_k:  # the pending group finished before step k: they decode in it
                joined += pend_g
                joined_k += pend_g * pend_k
                pend_g, pend_k = 0.0, k
            shared = 1 if k * p > end and i + 1 < len(queue) else 0  # the next request's chunk shares step k
            t = k * t0 + b * min(k * p, total) + c * (touches + shared) + d * ctx + k * joined - joined_k
            worst = max(worst, q.age_s + t)
            pend_g += b + c + d * (q.context + q.tokens)
        return step1, worst, p, new1


def _solve(m: list[list[float]]) -> list[float]:
    """Gaussian elimination with partial pivoting on an augmented matrix (modified in place)."""
    n = len(m)
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            continue
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for j in range(col, n + 1):
                    m[r][j] -= f * m[col][j]
    sol = [0.0] * n
    for i in range(n - 1, -1, -1):
        if abs(m[i][i]) < 1e-300:
            continue
        sol[i] = (m[i][n] - sum(m[i][j] * sol[j] for j in range(i + 1, n))) / m[i][i]
    return sol
