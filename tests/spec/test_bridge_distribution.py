"""Sampled speculation across a vocabulary bridge: a draft model whose embedding has
another number of rows than the target's vocabulary (more: its logits are cut; fewer:
padded with -inf, and target ids past its rows reach it as id 0) still gives exactly
the target's processed distribution (chi-square over output[1..3], as
tests/spec/test_distribution.py), and the same test rejects a broken residual."""

import pytest
import torch

from drafters.draft_model import ModelDrafter
from engine.spec_decode import rejection_sampler
from tests.spec.bigram import BigramLM, bigram_table, perturbed
from tests.spec.distribution import (
    NUM_SAMPLES,
    SETTINGS,
    V,
    exact_joint,
    make_engine,
    p_value,
    resample_from_p,
    sample_joint,
)
from tests.spec.test_distribution import TARGET, bigram_logits


def bridged_drafter(draft_vocab: int) -> ModelDrafter:
    """A bigram draft over ``draft_vocab`` ids (its first V x V corner near the target's)."""
    table = perturbed(bigram_table(draft_vocab, seed=1), seed=2)
    n = min(draft_vocab, V)
    table[:n, :n] = 0.5 * table[:n, :n] + 0.5 * TARGET[:n, :n]
    table = table / table.sum(1, keepdim=True)
    return ModelDrafter(BigramLM(table), 1, 3000, 16, torch.float32, torch.device("cpu"), 0.1, target_vocab=V)


@pytest.mark.parametrize("draft_vocab, settings", [
    pytest.param(V + 2, SETTINGS[0], id="wider-t1.0"),
    pytest.param(V - 2, SETTINGS[1], id="narrower-t0.7-p0.9", marks=pytest.mark.slow),
])
def test_bridged_draft_rounds_emit_target_distribution(draft_vocab, settings):
    engine = make_engine(BigramLM(TARGET), bridged_drafter(draft_vocab))
    counts = sample_joint(engine, settings, NUM_SAMPLES)
    assert p_value(counts, exact_joint(bigram_logits, settings)) > 1e-3


@pytest.mark.slow
def test_the_bridge_test_rejects_a_broken_sampler(monkeypatch):
    monkeypatch.setattr(rejection_sampler, "residual_distribution", resample_from_p)
    engine = make_engine(BigramLM(TARGET), bridged_drafter(V + 2))
    counts = sample_joint(engine, SETTINGS[0], NUM_SAMPLES)
    assert p_value(counts, exact_joint(bigram_logits, SETTINGS[0])) < 1e-3
