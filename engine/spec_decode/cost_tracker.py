"""The policy's step-cost table ``T(R)``: measured at start-up
(``measure_step_costs``), then kept up to date from the steps the engine runs
(``CostTracker``).

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

and every entry above ``r_i+1`` moves by the same factor as ``s_i+1``: rows
beyond the observed ones are predicted to drift as the nearest observed row
did. Without that, the largest plain batch (64 requests) pulled its entry up
to the one above it, which no plain step ever reaches, and drafts at that
batch looked free (measured: 5,816 drafts, 15% accepted, 0.74x of plain in one
64-request wave). The policy's relative table is ``s / s_0``, made
non-decreasing. One slow step moves an entry by at most ``alpha`` (5%).
Observations come only from steps already run: the plan of a step never
depends on its own drafts.

Only plain decode steps move the table. A step that verifies drafts also runs
the verification rule and builds the drafts' metadata; what it took beyond the
table's prediction for its rows is averaged (same ``alpha``, at least 0) into
``verify_fixed``, the fixed cost of a verifying pass that the policy charges a
step's drafts as a whole (``SpecPolicy._step_pays``).
"""

import bisect
import time

import torch

from engine.attention import SeqSpec
from engine.spec_decode.policy import StepCosts

ALPHA = 0.05  # weight of one observation
MAX_RATIO = 2.0  # an observation counts at most as twice (or half) its prediction


class CostTracker:
    def __init__(self, costs: StepCosts):
        """``costs``: the start-up table, timed (``one_token_s`` > 0)."""
        if costs.one_token_s <= 0:
            raise ValueError("a tracked cost table must be timed (one_token_s > 0)")
        self.rows = costs.rows
        self.seconds = [c * costs.one_token_s for c in costs.costs]
        self.verify_extra_s = 0.0  # what a verifying step took beyond the table (average)
        self.num_observed = 0

    def observe(self, rows: int, seconds: float, verified: bool = False) -> StepCosts:
        """A decode step of ``rows`` tokens (``verified``: some of them drafts) took
        ``seconds``; returns the updated table."""
        r = self.rows
        i = min(max(bisect.bisect_right(r, rows) - 1, 0), len(r) - 2)
        w = min(max((rows - r[i]) / (r[i + 1] - r[i]), 0.0), 1.0)
        predicted = (1 - w) * self.seconds[i] + w * self.seconds[i + 1]
        self.num_observed += 1
        if verified:
            extra = min(max(seconds - predicted, 0.0), predicted)
            self.verify_extra_s += ALPHA * (extra - self.verify_extra_s)
            return self.table()
        ratio = min(max(seconds / predicted, 1 / MAX_RATIO), MAX_RATIO)
        self.seconds[i] *= 1 + ALPHA * (1 - w) * (ratio - 1)
        above = 1 + ALPHA * w * (ratio - 1)
        for j in range(i + 1, len(self.seconds)):
            self.seconds[j] *= above
        return self.table()

    def table(self) -> StepCosts:
        costs, floor = [], 1.0
        for s in self.seconds:
            floor = max(floor, s / self.seconds[0])
            costs.append(floor)
        return StepCosts(self.rows, tuple(costs), one_token_s=self.seconds[0],
                         verify_fixed=self.verify_extra_s / self.seconds[0])


@torch.inference_mode()
def measure_step_costs(model, runner, max_rows: int, block_size: int, max_len: int, repeats: int = 6) -> StepCosts:
    """``T(R)`` for ``R`` = 1, 2, 3, 5, 9, 17, 33, ... up to ``max_rows`` tokens in one pass.

    Times passes of one request over ``R`` new tokens after 256 tokens of
    context, with logits for every row as verification needs, in the (still
    empty) KV cache. Call before serving.
    """
    device = runner.device
    max_rows = max(2, min(max_rows, max_len - 1))
    context = max(1, min(256, max_len - max_rows))
    blocks = list(range(-(-(context + max_rows) // block_size)))
    ids = torch.randint(0, model.config.vocab_size, (context + max_rows,), device=device)

    def run(n: int) -> float:
        meta = runner.attention.build_metadata([SeqSpec(context, n, blocks)], block_size, device)
        pos = torch.arange(context, context + n, device=device)
        t = time.perf_counter()
        model.compute_logits(model(ids[context : context + n], pos, meta, runner.kv)).argmax(-1)
        return time.perf_counter() - t

    meta = runner.attention.build_metadata([SeqSpec(0, context, blocks)], block_size, device)
    model(ids[:context], torch.arange(context, device=device), meta, runner.kv)
    rows = sorted({r for r in (1, 2, 3, 5, 9, 17, 33, 65, 129, 257) if r < max_rows} | {max_rows})
    # Interleaved, and the minimum of each: robust to other work on a shared machine.
    times = [[run(r) for r in rows] for _ in range(repeats)]
    best = [min(t[i] for t in times) for i in range(len(rows))]
    # More rows never cost less: a slow outlier at some R is capped by the larger R after it.
    costs = [max(1.0, min(best[i:]) / best[0]) for i in range(len(rows))]
    return StepCosts(tuple(rows), tuple(costs), one_token_s=best[0])
