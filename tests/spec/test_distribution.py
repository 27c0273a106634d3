"""Whole speculative rounds through the real engine path emit exactly the
target's processed distribution (chi-square over many samples), for every
drafter, and the same test rejects a sampler that resamples from p instead of
the residual (the test has power). The joint measured is that of output[1..3]:
with k = 2 drafts after the prefill's token, it holds drafted positions and,
when both drafts are accepted, the round's bonus token (``sample_joint``
checks that this happens)."""

import numpy as np
import pytest
import torch

from drafters.draft_model import ModelDrafter
from drafters.ngram import NgramDrafter
from engine.spec_decode import rejection_sampler
from tests.spec.bigram import BigramLM, bigram_table, perturbed
from tests.spec.distribution import (
    METHOD_SETTINGS,
    NUM_SAMPLES,
    SETTINGS,
    V,
    exact_joint,
    llama_logits,
    make_engine,
    p_value,
    resample_from_p,
    sample_joint,
    tiny_llama,
)

TARGET = bigram_table(V, seed=1)
DRAFT = perturbed(TARGET, seed=2)


def bigram_logits(context: list[int]) -> np.ndarray:
    return np.log(TARGET[context[-1]].double().numpy())


def build(method):
    target = BigramLM(TARGET)
    if method == "ngram":
        return target, NgramDrafter(1, 3)
    return target, ModelDrafter(BigramLM(DRAFT), 1, 3000, 16, torch.float32, torch.device("cpu"), 0.1)


# Under slow: the default suite samples prompt lookup's and the draft model's chains through the
# mixed-batch tests (both drafters in one batch) and the grammar test.
BIGRAM_CASES = [pytest.param(*p.values, id=p.id, marks=pytest.mark.slow) for p in METHOD_SETTINGS]


@pytest.mark.parametrize("method, settings", BIGRAM_CASES)
def test_bigram_rounds_emit_target_distribution(method, settings):
    """The joint of output[1..3]: two drafted positions and the round's bonus token."""
    engine = make_engine(*build(method))
    counts = sample_joint(engine, settings, NUM_SAMPLES)
    assert p_value(counts, exact_joint(bigram_logits, settings)) > 1e-3


@pytest.mark.slow  # a power check: the distribution test it backs runs in the default suite
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_the_distribution_test_rejects_a_broken_sampler(method, monkeypatch):
    monkeypatch.setattr(rejection_sampler, "residual_distribution", resample_from_p)
    engine = make_engine(*build(method))
    counts = sample_joint(engine, SETTINGS[0], NUM_SAMPLES)
    assert p_value(counts, exact_joint(bigram_logits, SETTINGS[0])) < 1e-3


# ---- early exit: a tiny multi-layer Llama whose first layer drafts for it ----


# The default suite runs early exit's rounds and their power check on the quantized target
# (tests/quant/test_quant_spec.py).
@pytest.mark.slow
@pytest.mark.parametrize("settings", [pytest.param(SETTINGS[0], id="t1.0"), pytest.param(SETTINGS[1], id="t0.7-p0.9")])
def test_early_exit_rounds_emit_target_distribution(settings):
    target = tiny_llama()
    counts = sample_joint(make_engine(target, None), settings, NUM_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), settings)) > 1e-3


@pytest.mark.slow
def test_early_exit_test_rejects_a_broken_sampler(monkeypatch):
    monkeypatch.setattr(rejection_sampler, "residual_distribution", resample_from_p)
    target = tiny_llama()
    counts = sample_joint(make_engine(target, None), SETTINGS[0], NUM_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), SETTINGS[0])) < 1e-3
