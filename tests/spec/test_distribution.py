"""Whole speculative rounds through the real engine path emit exactly the
target's processed distribution (chi-square over many samples), for every
drafter, and the same test rejects a sampler that resamples from p instead of
the residual (the test has power). The joint measured is that of output[1..3]:
with k = 2 drafts after the prefill's token, it holds drafted positions and,
when both drafts are accepted, the round's bonus token (``sample_joint``
checks that this happens)."""

import functools

import numpy as np
import pytest
import torch

from drafters.draft_model import ModelDrafter
from drafters.ngram import NgramDrafter
from engine.spec_decode import rejection_sampler
from tests.spec.bigram import BigramLM, bigram_table, perturbed
from tests.spec.distribution import V, exact_joint, make_engine, p_value, sample_joint

NUM_SAMPLES = 20_000
SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)]


TARGET = bigram_table(V, seed=1)
DRAFT = perturbed(TARGET, seed=2)


def bigram_logits(context: list[int]) -> np.ndarray:
    return np.log(TARGET[context[-1]].double().numpy())


def build(method):
    target = BigramLM(TARGET)
    if method == "ngram":
        return target, NgramDrafter(1, 3)
    return target, ModelDrafter(BigramLM(DRAFT), 1, 3000, 16, torch.float32, torch.device("cpu"), 0.1)


@pytest.mark.parametrize("settings", SETTINGS, ids=["t1.0", "t0.7-p0.9"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_bigram_rounds_emit_target_distribution(method, settings):
    """The joint of output[1..3]: two drafted positions and the round's bonus token."""
    engine = make_engine(*build(method))
    counts = sample_joint(engine, settings, NUM_SAMPLES)
    assert p_value(counts, exact_joint(bigram_logits, settings)) > 1e-3


def _resample_from_p(p, q):
    """The classic bug: after a rejection, sample from p instead of the residual."""
    return p


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_the_distribution_test_rejects_a_broken_sampler(method, monkeypatch):
    monkeypatch.setattr(rejection_sampler, "residual_distribution", _resample_from_p)
    engine = make_engine(*build(method))
    counts = sample_joint(engine, SETTINGS[0], NUM_SAMPLES)
    assert p_value(counts, exact_joint(bigram_logits, SETTINGS[0])) < 1e-3


# ---- early exit: a tiny multi-layer Llama whose first layer drafts for it ----


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig

    from engine.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Later layers get smaller weights, so the first layer alone is a fair draft.
            std = 0.5 if "embed" in name or "lm_head" in name else 0.3 if "layers.0." in name else 0.25
            param.copy_(torch.randn(param.shape, generator=gen) * std)
            if "norm" in name:
                param.fill_(1.0)
    return model.eval()


def llama_logits(model):
    """``context -> the model's raw next-token logits`` from one fresh prefill, memoized."""
    from engine.attention import SeqSpec, build_attention_metadata
    from engine.models.llama import head_dim_of
    from kvcache.tensors import KVSpec, PagedKV

    cfg = model.config

    @functools.cache
    def logits(context: tuple[int, ...]) -> np.ndarray:
        spec = KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), 16, torch.float32)
        kv = PagedKV(spec, 4, "cpu")
        meta = build_attention_metadata([SeqSpec(0, len(context), [0, 1, 2, 3])], 16)
        with torch.inference_mode():
            hidden = model(torch.tensor(context), torch.arange(len(context)), meta, kv)
            return model.compute_logits(hidden[-1:])[0].double().numpy()

    return lambda context: logits(tuple(context))


@pytest.mark.parametrize("settings", SETTINGS, ids=["t1.0", "t0.7-p0.9"])
def test_early_exit_rounds_emit_target_distribution(settings):
    target = tiny_llama()
    counts = sample_joint(make_engine(target, None), settings, NUM_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), settings)) > 1e-3


def test_early_exit_test_rejects_a_broken_sampler(monkeypatch):
    monkeypatch.setattr(rejection_sampler, "residual_distribution", _resample_from_p)
    target = tiny_llama()
    counts = sample_joint(make_engine(target, None), SETTINGS[0], NUM_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), SETTINGS[0])) < 1e-3
