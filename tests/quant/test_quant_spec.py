"""Speculation on quantized weights, on the fused C path (one C call per layer) that a CPU
runs by default. The target is a tiny Llama whose matrices are Q4_1 (the head Q8_0) at
hidden size 128, so every row spans 4 blocks and every activation row 4 scales.

- Each logit row of a step (a prefill's, a verification pass's at any position of a
  chain, beside any other rows) is the bits of a plain forward of that row's context.
- Sampling stays exact against the quantized target's own distribution with each kind
  of drafter: early exit (its first layer), prompt lookup (ngram) and a separate,
  smaller Q4_1 model (hidden size 64, 2 blocks a row); chi-square over the joint of
  output[1..3], and the same test rejects a sampler that resamples from p (power).

Greedy speculation on the default model's Q4_1 blocks equals plain decoding of them:
tests/spec/test_greedy_equivalence.py, which runs on the served default."""

from collections import defaultdict

import numpy as np
import pytest
import torch

from drafters.draft_model import ModelDrafter
from drafters.ngram import NgramDrafter
from engine import SamplingParams
from engine.attention.backends import CPU
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
    run_groups,
    sample_joint,
    tiny_llama,
)

pytestmark = pytest.mark.skipif(quant.load() is None, reason="no CPU kernels here (AVX2, a C compiler)")

HIDDEN = 128  # 4 blocks of 32 weights a row


def quantized_llama(hidden_size: int = HIDDEN, seed: int = 0):
    model = tiny_llama(seed=seed, hidden_size=hidden_size)
    model.prepack(quant.QUANTIZE_TO["int4"])  # Q4_1 layers, Q8_0 head
    assert model.lm_head.qweight.kinds == ["Q8_0"]
    assert model.layers[0].mlp.gate_up_proj.qweight.kinds == ["Q4_1"]
    assert model.fused is not None  # whole layers in one C call each
    return model


def drafter(method: str):
    """None: the target's first layer drafts (early_exit)."""
    if method == "ngram":
        return NgramDrafter(1, 3)
    if method == "draft_model":
        draft = quantized_llama(hidden_size=64, seed=3)
        return ModelDrafter(draft, 3, 3000, 16, torch.float32, torch.device("cpu"), 0.1, attention=CPU)
    return None


def record_rows(engine) -> dict[tuple[int, ...], set[bytes]]:
    """context -> the bits of every logit row the engine computed after it, as ``(kind,
    bits)``: kind ``plain`` (no drafts) or ``(i, k)`` (row i of a chain of k drafts)."""
    runner, rows = engine.runner, defaultdict(set)
    sample_or_verify = runner._sample_or_verify

    def record(logits, sched, drafts):
        at = 0
        for s in sched:
            context = tuple(runner.requests[s.request_id].token_ids)
            chain = tuple(drafts[s.request_id].token_ids) if s.request_id in drafts else ()
            for i in range(len(chain) + 1):
                rows[context + chain[:i]].add(("plain" if not chain else (i, len(chain)), logits[at].numpy().tobytes()))
                at += 1
        return sample_or_verify(logits, sched, drafts)

    runner._sample_or_verify = record
    return rows


@pytest.mark.parametrize("method", ["early_exit", "ngram"])
def test_every_logit_row_is_the_bits_of_a_plain_forward(method):
    """Prefill rows and rows 0..2 of verified chains, in steps of one to a thousand rows,
    against one fresh prefill of each row's context (``llama_logits``)."""
    target = quantized_llama()
    engine = make_engine(target, drafter(method))
    rows = record_rows(engine)
    run_groups(engine, [(SamplingParams(max_tokens=4, ignore_eos=True, **SETTINGS[0]), 300)])
    expected = llama_logits(target)
    kinds = {kind for seen in rows.values() for kind, _ in seen}
    assert {"plain", (0, 2), (1, 2), (2, 2)} <= kinds, kinds
    for context, seen in rows.items():
        want = expected(list(context)).astype(np.float32)
        for kind, bits in seen:
            got = np.frombuffer(bits, dtype=np.float32)
            assert got.tobytes() == want.tobytes(), (context, kind, np.abs(got - want).max())


@pytest.mark.parametrize("method, settings", [
    pytest.param("early_exit", SETTINGS[0], id="early_exit-t1.0"),
    pytest.param("ngram", SETTINGS[0], id="ngram-t1.0", marks=pytest.mark.slow),
    pytest.param("draft_model", SETTINGS[0], id="draft_model-t1.0", marks=pytest.mark.slow),
    pytest.param("early_exit", SETTINGS[1], id="early_exit-t0.7-p0.9", marks=pytest.mark.slow),
    pytest.param("ngram", SETTINGS[1], id="ngram-t0.7-p0.9", marks=pytest.mark.slow),
    pytest.param("draft_model", SETTINGS[1], id="draft_model-t0.7-p0.9", marks=pytest.mark.slow),
])
def test_rounds_emit_the_quantized_target_distribution(method, settings):
    target = quantized_llama()
    counts = sample_joint(make_engine(target, drafter(method)), settings, NUM_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), settings)) > 1e-3


@pytest.mark.slow  # a power check: the distribution test it backs runs in the default suite
@pytest.mark.parametrize("method", ["early_exit", "ngram", "draft_model"])
def test_the_test_rejects_a_broken_sampler_on_the_quantized_target(method, monkeypatch):
    monkeypatch.setattr(rejection_sampler, "residual_distribution", resample_from_p)
    target = quantized_llama()
    counts = sample_joint(make_engine(target, drafter(method)), SETTINGS[0], NUM_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), SETTINGS[0])) < 1e-3
