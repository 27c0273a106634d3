"""Keeps the policy's step-cost table ``T(R)`` up to date from the steps the engine runs.

The table is timed once at start-up, on an idle engine; a machine's state then
drifts (other processes, memory bandwidth shared with neighbours, the event
loop's work beside the engine), and with it the price of verification. Each
decode step (no prompt tokens in it, so its time is a function of its rows)
is an observation ``(R, seconds)``. The table is held in seconds at its
measured rows; an observation between rows ``r_i`` and ``r_i+1`` pulls both
towards it in proportion to their interpolation weights::

    w = (R - r_i) / (r_i+1 - r_i)            predicted = (1 - w) s_i + w s_i+1
    ratio = clip(seconds / predicted, 1/2, 2)
    s_i   *= 1 + alpha (1 - w) (ratio - 1)   s_i+1 *= 1 + alpha w (ratio - 1)

and the policy's relative table is ``s / s_0``, made non-decreasing. One slow
step moves an entry by at most ``alpha`` (5%). Observations come only from
steps already run: the plan of a step never depends on its own drafts.
"""

import bisect

from engine.spec_policy import StepCosts

ALPHA = 0.05  # weight of one observation
MAX_RATIO = 2.0  # an observation counts at most as twice (or half) its prediction


class CostTracker:
    def __init__(self, costs: StepCosts):
        """``costs``: the start-up table, timed (``one_token_s`` > 0)."""
        if costs.one_token_s <= 0:
            raise ValueError("a tracked cost table must be timed (one_token_s > 0)")
        self.rows = costs.rows
        self.seconds = [c * costs.one_token_s for c in costs.costs]
        self.num_observed = 0

    def observe(self, rows: int, seconds: float) -> StepCosts:
        """A decode step of ``rows`` tokens took ``seconds``; returns the updated table."""
        r = self.rows
        i = min(max(bisect.bisect_right(r, rows) - 1, 0), len(r) - 2)
        w = min(max((rows - r[i]) / (r[i + 1] - r[i]), 0.0), 1.0)
        predicted = (1 - w) * self.seconds[i] + w * self.seconds[i + 1]
        ratio = min(max(seconds / predicted, 1 / MAX_RATIO), MAX_RATIO)
        self.seconds[i] *= 1 + ALPHA * (1 - w) * (ratio - 1)
        self.seconds[i + 1] *= 1 + ALPHA * w * (ratio - 1)
        self.num_observed += 1
        return self.table()

    def table(self) -> StepCosts:
        costs, floor = [], 1.0
        for s in self.seconds:
            floor = max(floor, s / self.seconds[0])
            costs.append(floor)
        return StepCosts(self.rows, tuple(costs), one_token_s=self.seconds[0])
