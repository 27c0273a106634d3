"""The policy at high load: draft rows only where the measured costs pay for them.

A table timed on a loaded 2-core AVX2 machine (SmolLM2-135M, ngram with 16 drafts, 64
requests at most: rows up to 64 + 16) came out with its largest row no dearer than the
one before: every draft past 65 rows looked free, and at 64 requests the policy drafted
16 a request at an acceptance of 0.2.
"""

import random

import pytest

from engine.config import SpeculativeConfig
from engine.sampling_params import SamplingParams
from engine.spec_decode.cost_tracker import shaped
from engine.spec_decode.policy import Candidate, SpecPolicy, StepCosts

ROWS = (1, 2, 3, 5, 9, 17, 33, 65, 80)
TIMED = (1.0, 1.0, 1.0, 1.30, 1.73, 2.61, 4.55, 6.89, 6.89)  # T(R) / T(1) as timed there


def test_a_row_past_an_entry_costs_at_least_half_the_mean_of_the_rows_before_it():
    costs = shaped(ROWS, list(TIMED))
    assert costs[:8] == TIMED[:8]  # every segment up to 65 rows at least half the mean before it
    mean = (TIMED[7] - 1) / 64  # of the rows 2..65
    assert costs[8] == pytest.approx(TIMED[7] + 0.5 * mean * 15)  # 65 -> 80 came out free
    # Real shapes are kept: a staircase of register groups (1-4 rows at the price of one, then
    # a step), and rows that get cheaper as they grow (oneDNN's blocking, a per-row dequantization).
    stairs = (1.0, 1.0, 1.0, 1.25, 1.5, 2.0)
    assert shaped(ROWS[:6], list(stairs)) == stairs
    falling = (1.0, 1.43, 1.95, 2.46, 3.66, 6.37, 10.24, 18.19, 20.8)  # a quantized model's, timed
    assert shaped(ROWS, list(falling)) == falling
    assert shaped((1, 2, 5), [1.0, 0.9, 1.2]) == (1.0, 1.0, 1.2)  # never below a one-token pass


def simulate(costs: StepCosts, acceptance: float, batch: int = 64, steps: int = 400) -> tuple[float, float]:
    """``batch`` ngram requests decoding for ``steps`` steps, each draft accepted with
    probability ``acceptance`` while the ones before it were: (draft tokens per 100 output
    tokens, output tokens per request and step)."""
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=16), 0.0, costs)
    rng, drafted, tokens = random.Random(0), 0, 0
    candidates = [Candidate(f"r{i}", 4) for i in range(batch)]
    for _ in range(steps):
        plan = policy.plan(candidates, batch)
        for rid, d in plan.decisions.items():
            accepted = 0
            while accepted < d.num_draft_tokens and rng.random() < acceptance:
                accepted += 1
            policy.record(rid, d, d.num_draft_tokens, accepted)
            drafted += d.num_draft_tokens
            tokens += accepted
        tokens += batch
        policy.end_step(plan)
    return 100 * drafted / tokens, tokens / (batch * steps)


def test_at_64_requests_with_low_acceptance_drafting_backs_off_to_almost_plain():
    """Each draft row costs about a request's share of a step there: at an acceptance of
    0.2 the policy probes now and then and otherwise decodes plainly (the timed table as
    it came out drafted ~60 tokens per 100 output tokens)."""
    drafts, _ = simulate(StepCosts(ROWS, shaped(ROWS, list(TIMED))), acceptance=0.2)
    assert drafts < 3


def test_at_64_requests_cheap_rows_and_high_acceptance_still_draft():
    rows, timed = (1, 65, 80, 129), (1.0, 1.1, 1.15, 1.4)  # a memory-bound pass: rows nearly free
    assert shaped(rows, list(timed)) == timed
    drafts, per_step = simulate(StepCosts(rows, timed), acceptance=0.8)
    assert drafts > 50 and per_step > 1.5


def test_an_engine_of_64_requests_whose_copies_miss_decodes_almost_plainly(make_engine, tiny_model):
    """Through the engine: 64 requests whose prompts repeat a pattern (prompt lookup proposes
    its continuation at every step) on a random model that does not follow it, priced by the
    shaped table above: plain decoding, bar a few probes (the timed table as it came out
    drafts ~30 tokens per 100 output tokens here)."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=16, prompt_lookup_max=8)
    engine = make_engine(tiny_model(), speculative=spec, num_blocks=512, max_num_seqs=64, max_num_batched_tokens=2048)
    engine.speculator.policy.step_costs = StepCosts(ROWS, shaped(ROWS, list(TIMED)))
    engine.speculator.cost_tracker = None  # the table stays as given
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for i in range(64):
        engine.add_request(f"r{i}", [7 + i % 5, 8, 9, 10] * 6, params)
    drafted = []
    record = engine.speculator.policy.record
    engine.speculator.policy.record = lambda rid, d, n, *a, **k: drafted.append(n) or record(rid, d, n, *a, **k)
    while engine.has_unfinished():
        engine.step()
    assert 100 * sum(drafted) / (64 * 24) < 5
