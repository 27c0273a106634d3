"""Rounds drafted by an EAGLE head (random weights, on a tiny Llama) emit exactly the
target's processed distribution, and the same test rejects a sampler that resamples
from p instead of the residual (it has power). See tests/spec/test_distribution.py."""

import pytest
import torch

from drafters.eagle import EagleDrafter
from engine import rejection_sampler
from tests.spec.distribution import exact_joint, make_engine, p_value, sample_joint
from tests.spec.eagle_heads import random_head
from tests.spec.test_distribution import NUM_SAMPLES, SETTINGS, _resample_from_p, llama_logits, tiny_llama


def eagle_engine(kind: str):
    target = tiny_llama()
    head = random_head(target, kind, seed=3, draft_vocab=5 if kind == "eagle3" else None, std=0.5)
    return target, make_engine(target, EagleDrafter(head, 3000, 16, torch.float32, torch.device("cpu"), 0.1))


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.slow  # 20,000 requests
@pytest.mark.timeout(3600)
def test_eagle_rounds_emit_target_distribution(kind):
    target, engine = eagle_engine(kind)
    counts = sample_joint(engine, SETTINGS[1], NUM_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), SETTINGS[1])) > 1e-3


@pytest.mark.slow  # 20,000 requests
@pytest.mark.timeout(3600)
def test_the_eagle_distribution_test_rejects_a_broken_sampler(monkeypatch):
    monkeypatch.setattr(rejection_sampler, "residual_distribution", _resample_from_p)
    target, engine = eagle_engine("eagle3")
    counts = sample_joint(engine, SETTINGS[1], NUM_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), SETTINGS[1])) < 1e-3
