"""Speculation on quantized weights. Sampling stays exact against the quantized target's
own distribution: early-exit rounds on a tiny Llama whose matrices are Q4_1 (the head
Q8_0) emit it (chi-square), and the same test rejects a broken residual (power). Greedy
speculation on the default model's Q4_1 blocks equals plain decoding of them:
tests/spec/test_greedy_equivalence.py, which runs on the served default."""

import pytest

from engine.layers import quant
from engine.spec_decode import rejection_sampler
from tests.spec.distribution import (
    NUM_SAMPLES,
    SETTINGS,
    exact_joint,
    llama_logits,
    make_engine,
    p_value,
    resample_from_p,
    sample_joint,
    tiny_llama,
)

pytestmark = pytest.mark.skipif(quant.load() is None, reason="no CPU kernels here (AVX2, a C compiler)")


def quantized_llama(hidden_size: int = 32):
    model = tiny_llama(hidden_size=hidden_size)
    model.prepack(quant.QUANTIZE_TO["int4"])  # Q4_1 layers, Q8_0 head
    assert model.lm_head.qweight.kinds == ["Q8_0"]
    assert model.layers[0].mlp.gate_up_proj.qweight.kinds == ["Q4_1"]
    return model


@pytest.mark.parametrize("settings", [pytest.param(SETTINGS[0], id="t1.0"),  # the float test runs t0.7-p0.9
                                      pytest.param(SETTINGS[1], id="t0.7-p0.9", marks=pytest.mark.slow)])
def test_early_exit_rounds_emit_the_quantized_target_distribution(settings):
    target = quantized_llama()
    counts = sample_joint(make_engine(target, None), settings, NUM_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), settings)) > 1e-3


def test_the_test_rejects_a_broken_sampler_on_the_quantized_target(monkeypatch):
    monkeypatch.setattr(rejection_sampler, "residual_distribution", resample_from_p)
    target = quantized_llama()
    counts = sample_joint(make_engine(target, None), SETTINGS[0], NUM_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), SETTINGS[0])) < 1e-3


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="with the cpu attention backend (whole-layer C calls on Q4_1 blocks) "
                   "at hidden size 128 / head size 32, the engine's log-probabilities differ from the layer "
                   "modules' by up to 0.09 (exact with --attention-backend torch, and in float32)")
def test_early_exit_rounds_emit_the_quantized_target_distribution_with_multi_block_rows():
    target = quantized_llama(hidden_size=128)
    counts = sample_joint(make_engine(target, None), SETTINGS[0], NUM_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), SETTINGS[0])) > 1e-3
