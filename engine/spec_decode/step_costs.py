"""``StepCosts``: the time of a target pass over ``R`` tokens, the table the policy prices
drafts by (engine.spec_decode.policy; measured by engine.spec_decode.cost_tracker). No torch."""

import bisect
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCosts:
    """``T(R)``: the time of a target pass over ``R`` tokens relative to one token,
    measured at a few ``rows`` (increasing, from 1), linear in between and beyond."""

    rows: tuple[int, ...]
    costs: tuple[float, ...]  # non-decreasing, costs[0] = 1
    # Price every request alone, as at batch 1, whatever the batch: the choices, and
    # so a seeded request's random draws, then do not depend on the other requests.
    per_request: bool = False
    one_token_s: float = 0.0  # seconds of a one-token pass when timed (0: a pinned cost)
    # What a pass that verifies drafts costs beyond T(R) for its rows (building the drafts'
    # metadata, the verification rule): one-token passes, observed online (CostTracker).
    verify_fixed: float = 0.0

    @classmethod
    def linear(cls, per_token: float) -> "StepCosts":
        """A pinned cost: every extra token costs ``per_token`` of a one-token pass, per request."""
        return cls((1, 2), (1.0, 1.0 + per_token), per_request=True)

    def __call__(self, rows: float) -> float:
        r, c = self.rows, self.costs
        i = min(max(bisect.bisect_right(r, rows) - 1, 0), len(r) - 2)
        return c[i] + (c[i + 1] - c[i]) * (rows - r[i]) / (r[i + 1] - r[i])

    def verify(self, drafts: int, batch: int, rows: int | None = None) -> float:
        """``V``: a round with ``drafts`` drafts for one of ``batch`` decoding requests, in
        units of that request's share of a plain step; ``rows``: tokens already in the
        pass (default ``batch``)."""
        return self.verify_at((drafts,), batch, rows)[0]

    def verify_at(self, drafts: Iterable[int], batch: int, rows: int | None = None) -> list[float]:
        """``verify`` at each of several draft counts, the terms that do not depend on the
        count computed once."""
        if self.per_request:
            return [self(1 + g) for g in drafts]
        rows = batch if rows is None else rows
        t_rows, t_batch = self(rows), self(batch)
        return [1.0 + (self(rows + g) - t_rows) * batch / t_batch for g in drafts]
