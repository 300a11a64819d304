"""SLA-driven step budget: choose the per-step token budget from measured step times so that latency targets hold.

Every running request gets one token per step, so a step's duration is every decoding request's time per output
token: keeping steps under the TPOT target bounds TPOT. Step time is modelled as ``a + b * tokens`` and fitted
online with exponentially weighted least squares. With only a TTFT target, steps are kept under a quarter of it,
so a request arriving mid-step waits little before its prefill starts. Pure Python.
"""

from __future__ import annotations


class BudgetController:
    def __init__(self, max_budget: int, min_budget: int = 16, target_tpot_s: float | None = None,
                 target_ttft_s: float | None = None, alpha: float = 0.1) -> None:
        if target_tpot_s is None and target_ttft_s is None:
            raise ValueError("BudgetController needs a TPOT or a TTFT target")
        self.max_budget = max_budget
        self.min_budget = min(min_budget, max_budget)
        self.target_step_s = min(t for t in (target_tpot_s, None if target_ttft_s is None else target_ttft_s / 4)
                                 if t is not None)
        self.alpha = alpha
        self._n = 0
        self._mx = self._my = self._mxx = self._mxy = 0.0
        self.current = max_budget

    def observe(self, num_tokens: int, step_time_s: float) -> None:
        if num_tokens <= 0:
            return
        w = self.alpha if self._n >= 10 else 1.0 / (self._n + 1)  # plain averages while warming up
        x, y = float(num_tokens), float(step_time_s)
        self._mx += w * (x - self._mx)
        self._my += w * (y - self._my)
        self._mxx += w * (x * x - self._mxx)
        self._mxy += w * (x * y - self._mxy)
        self._n += 1
        self.current = self._choose()

    def model(self) -> tuple[float, float]:
        """(a, b): fixed seconds per step and seconds per token."""
        var = self._mxx - self._mx ** 2
        if self._n >= 3 and var > 1e-9 * max(self._mx ** 2, 1.0):
            b = (self._mxy - self._mx * self._my) / var
            if b > 0:
                return max(self._my - b * self._mx, 0.0), b
        return 0.0, self._my / max(self._mx, 1.0)  # one step size seen so far: all cost per token (cautious)

    def _choose(self) -> int:
        a, b = self.model()
        if b <= 0:
            return self.max_budget
        budget = int((self.target_step_s - a) / b)
        return max(self.min_budget, min(self.max_budget, budget))

    def budget(self) -> int:
        return self.current
