"""Sampling through speculation emits exactly the target's processed distribution for a
sliding-window family (Mistral, a window of 4 positions: every drafted position and the
committed context it reads are cut by it) and a mixture-of-experts one (Mixtral, 4
experts, top 2): the joint of output[1..3] over 20,000 requests against the exact joint
enumerated from the model's own logits (chi-square), the target's first layer drafting
(its KV kept, rolled back and windowed as the target's). The same check rejects a
sampler that resamples from p instead of the residual (its power). A run takes tens of
seconds: the windowed family's runs in the default suite, the rest are slow."""

import pytest
import torch
import transformers

from engine.models.decoder import LlamaForCausalLM
from engine.models.registry import arch_of
from engine.spec_decode import rejection_sampler
from tests.spec.distribution import V, exact_joint, make_engine, p_value, sample_joint
from tests.spec.distribution import NUM_SAMPLES, SETTINGS, llama_logits, resample_from_p

SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
FAMILIES = {
    "mistral-window": lambda: transformers.MistralConfig(**SMALL, sliding_window=4),
    "mixtral-moe": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
}


def tiny(name: str, seed: int = 0) -> LlamaForCausalLM:
    """Our model of the family with seeded weights: later layers smaller, so that the first
    layer alone is a fair draft (accepted at times, rejected at others)."""
    config = FAMILIES[name]()
    config.architectures = [config.model_type.capitalize() + "ForCausalLM"]
    model = LlamaForCausalLM(config, arch=arch_of(config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            std = 0.5 if "embed" in pname or "lm_head" in pname else 0.3 if "layers.0." in pname else 0.25
            param.copy_(torch.randn(param.shape, generator=gen) * std)
            if "norm" in pname:
                param.fill_(1.0)
    return model.eval()


@pytest.mark.parametrize("name", ["mistral-window", pytest.param("mixtral-moe", marks=pytest.mark.slow)])
def test_rounds_emit_the_target_distribution(name):
    target = tiny(name)
    counts = sample_joint(make_engine(target, None), SETTINGS[0], NUM_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), SETTINGS[0])) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_check_rejects_a_broken_sampler(name, monkeypatch):
    monkeypatch.setattr(rejection_sampler, "residual_distribution", resample_from_p)
    target = tiny(name)
    counts = sample_joint(make_engine(target, None), SETTINGS[0], NUM_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), SETTINGS[0])) < 1e-3
