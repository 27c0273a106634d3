"""The policy's step-cost table ``T(R)``: measured at start-up
(``measure_step_costs``), then kept up to date from the steps the engine runs
(``CostTracker``).

The table is timed once at start-up, on an idle engine; a machine's state then
drifts (other processes, memory bandwidth shared with neighbours, the event
loop's work beside the engine), and with it the price of verification. Each
decode step (no prompt tokens in it, so its time is a function of its rows)
is an observation ``(R, seconds)``. The table is held in seconds at its
measured rows; an observation between rows ``r_i`` (included) and ``r_i+1``
pulls the row below it by its interpolation weight, and ``r_i+1`` and every
row above by the whole drift::

    w = (R - r_i) / (r_i+1 - r_i)            predicted = (1 - w) s_i + w s_i+1
    d = alpha (clip(seconds / predicted, 1/2, 2) - 1)
    s_i *= 1 + (1 - w) d                     s_j *= 1 + d   for every j > i

Rows beyond the observed ones drift as the observed row did, so the table keeps
its timed shape above the rows the steps reach: otherwise the largest observed
batch would pull its entry up to the unobserved one above, and drafts there
would look free. The policy's relative table is ``s / s_0``, shaped (``shaped``).
One slow step moves an entry by at most ``alpha`` (5%). Observations come only
from steps already run: the plan of a step never depends on its own drafts.

Every observation also pulls the relative costs back towards the start-up ones
by ``REVERT`` (0.2%: a half-life of ~350 steps without other news). The rows
above 1 are observed only while the policy drafts, and it drafts less where they
look dear, so an entry that noise pushed up would otherwise stay up for good.

Every decode step moves the table, verifying ones included: at batch 1 they are
the only steps that reach the rows above 1, whose start-up times are noisy. A
verifying step also runs the verification rule (``ModelRunner`` times it:
``RunnerOutput.verify_s``); the table takes the step's time without it, and the
rule's time is averaged (same ``alpha``) into ``verify_fixed``, the fixed cost of
a verifying pass, which the first request to draft in a step bears
(``SpecPolicy._verify_costs``). Timing the rule itself, rather than inferring it
as what verifying steps took beyond the table, keeps table drift from being read
as a verification cost that refuses cheap drafts.
"""

import bisect
import time

import torch

from engine.attention import SeqSpec
from engine.spec_decode.step_costs import StepCosts

ALPHA = 0.05  # weight of one observation
REVERT = 0.002  # pull of every observation on the relative costs back towards the start-up ones
MAX_RATIO = 2.0  # an observation counts at most as twice (or half) its prediction
MIN_MARGINAL = 0.5  # a row's cost past a table entry, at least, as a share of the mean of the rows before


class CostTracker:
    def __init__(self, costs: StepCosts):
        """``costs``: the start-up table, timed (``one_token_s`` > 0)."""
        if costs.one_token_s <= 0:
            raise ValueError("a tracked cost table must be timed (one_token_s > 0)")
        self.rows = costs.rows
        self.seconds = [c * costs.one_token_s for c in costs.costs]
        self.start = costs.costs  # the relative costs timed at start-up
        self.verify_s = 0.0  # the verification rule's time in a verifying step (average)
        self.num_observed = 0

    def observe(self, rows: int, seconds: float, verify_s: float = 0.0) -> StepCosts:
        """A decode step of ``rows`` tokens took ``seconds``, ``verify_s`` of them in the
        verification rule (0: no drafts); returns the updated table."""
        if verify_s > 0:
            self.verify_s += ALPHA * (verify_s - self.verify_s)
            seconds -= verify_s
        r = self.rows
        i = min(max(bisect.bisect_right(r, rows) - 1, 0), len(r) - 2)
        w = min(max((rows - r[i]) / (r[i + 1] - r[i]), 0.0), 1.0)
        predicted = (1 - w) * self.seconds[i] + w * self.seconds[i + 1]
        self.num_observed += 1
        drift = ALPHA * (min(max(seconds / predicted, 1 / MAX_RATIO), MAX_RATIO) - 1)
        self.seconds[i] *= 1 + (1 - w) * drift
        for j in range(i + 1, len(self.seconds)):
            self.seconds[j] *= 1 + drift
        s0 = self.seconds[0]
        for j in range(1, len(self.seconds)):
            self.seconds[j] += REVERT * (self.start[j] * s0 - self.seconds[j])
        return self.table()

    def table(self) -> StepCosts:
        costs = shaped(self.rows, [s / self.seconds[0] for s in self.seconds])
        return StepCosts(self.rows, costs, one_token_s=self.seconds[0], verify_fixed=self.verify_s / self.seconds[0])


def shaped(rows: tuple[int, ...], ratios: list[float]) -> tuple[float, ...]:
    """``T(R) / T(1)`` at ``rows`` (increasing, from 1), each row past an entry costing at
    least ``MIN_MARGINAL`` of the mean cost of the rows beyond the first before it: a
    kernel may get cheaper per row as rows grow, never nearly free, and a time that came
    out that low on a loaded machine is noise. Left as timed, it makes every row past it
    look free, and the policy fills a large batch with drafts that cost a full row each."""
    out = [1.0]
    for prev, r, ratio in zip(rows, rows[1:], ratios[1:]):
        mean = (out[-1] - 1) / (prev - 1) if prev > 1 else 0.0  # of the rows 2 .. prev
        out.append(max(ratio, out[-1] + MIN_MARGINAL * mean * (r - prev)))
    return tuple(out)


@torch.inference_mode()
def measure_step_costs(model, runner, max_rows: int, block_size: int, max_len: int, repeats: int = 6) -> StepCosts:
    """``T(R)`` for ``R`` = 1, 2, 3, 5, 9, 17, 33, ... up to ``max_rows`` tokens in one pass.

    A pass of ``R`` tokens is timed as a decode step of ``R`` requests, one new token
    each after 256 tokens of context of its own (fewer, or contexts shared, where the
    cache cannot hold that many), with logits for every row as verification needs, in
    the (still unused) KV cache. A draft then costs what one more request costs: a
    little more than it does (a request's drafts share its keys), where one request of
    ``R`` new tokens costs far less than ``R`` requests once their keys no longer fit
    the caches, and would price drafts too cheaply at large batches. Call before serving.
    """
    device = runner.device
    max_rows = max(2, min(max_rows, max_len - 1))
    context = max(1, min(256, max_len - 1, runner.kv.num_blocks * block_size - 1))
    per_request = -(-(context + 1) // block_size)  # blocks of one request's context and new token
    distinct = max(1, min(max_rows, runner.kv.num_blocks // per_request))
    tables = [list(range(g * per_request, (g + 1) * per_request)) for g in range(distinct)]
    ids = torch.randint(0, model.config.vocab_size, (max_rows,), device=device)

    def run(n: int) -> float:
        specs = [SeqSpec(context, 1, tables[i % distinct]) for i in range(n)]
        meta = runner.attention.build_metadata(specs, block_size, device)
        pos = torch.full((n,), context, dtype=torch.long, device=device)
        synchronize(device)
        t = time.perf_counter()
        model.compute_logits(model(ids[:n], pos, meta, runner.kv)).argmax(-1)
        synchronize(device)  # a GPU returns from the launches long before it has run them
        return time.perf_counter() - t

    rows = sorted({r for r in (1, 2, 3, 5, 9, 17, 33, 65, 129, 257) if r < max_rows} | {max_rows})
    run(1)  # warm-up
    # Interleaved, and the minimum of each: robust to other work on a shared machine.
    times = [[run(r) for r in rows] for _ in range(repeats)]
    best = [min(t[i] for t in times) for i in range(len(rows))]
    # A slow outlier at some R is capped by the larger R after it; a fast one is raised by ``shaped``.
    costs = shaped(tuple(rows), [min(best[i:]) / best[0] for i in range(len(rows))])
    return StepCosts(tuple(rows), costs, one_token_s=best[0])


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA); the CPU runs ops as they are called."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
