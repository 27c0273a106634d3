"""Whole speculative rounds through the real engine path emit exactly the
target's processed distribution (chi-square over many samples), for every
drafter, and the same test rejects a sampler that resamples from p instead of
the residual (the test has power)."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from drafters.draft_model import ModelDrafter
from drafters.ngram import NgramDrafter
from engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from engine import rejection_sampler
from engine.config import SpeculativeConfig
from engine.llm_engine import LLMEngine
from tests.spec.bigram import BigramLM, bigram_table, perturbed

V = 6
NUM_SAMPLES = 20_000
PROMPT = [0, 1, 2, 3, 4, 5, 0]  # every token occurs, so prompt lookup always finds a draft
SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)]


def processed(row: np.ndarray, temperature: float, top_p: float = 1.0) -> np.ndarray:
    """The processed distribution of one next-token row, written independently of engine.sampler."""
    logits = np.log(row) / temperature
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros_like(probs, dtype=bool)
    keep[order[before < top_p]] = True
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def exact_joint(next_probs, settings) -> np.ndarray:
    """P(output[1] = a, output[2] = b) for the bigram target, summed over output[0]."""
    p = np.stack([processed(next_probs(s), **settings) for s in range(V)])  # [prev, next]
    first = processed(next_probs(PROMPT[-1]), **settings)  # output[0]
    second = first @ p  # output[1]
    return second[:, None] * p  # [a, b]


def make_engine(target, drafter, k=2):
    """``drafter`` None: the target's first layer drafts (early_exit)."""
    method = "test" if drafter is not None else "early_exit"
    config = EngineConfig(
        ModelConfig(device="cpu", dtype="float32", max_model_len=64),
        CacheConfig(block_size=16, num_blocks=3000),
        SchedulerConfig(max_num_seqs=2048, max_num_batched_tokens=16384),
        SpeculativeConfig(method=method, num_speculative_tokens=k, num_layers=1, adaptive=False, verify_cost=0.1),
    )
    return LLMEngine(config, model=target, tokenizer=None, drafter=drafter)


def sample_joint(engine, settings) -> np.ndarray:
    """Joint counts of (output[1], output[2]) over NUM_SAMPLES requests; checks
    that drafts were both accepted and rejected along the way."""
    params = SamplingParams(max_tokens=4, ignore_eos=True, **settings)
    reqs = [engine.add_request(f"r{i}", PROMPT, params) for i in range(NUM_SAMPLES)]
    totals = {"drafted": 0, "accepted": 0}

    def log(stats):
        totals["drafted"] += stats.spec.num_draft_tokens
        totals["accepted"] += stats.spec.num_accepted_tokens

    engine.stat_loggers.append(log)
    while engine.has_unfinished():
        engine.step()
    counts = np.zeros((V, V))
    for r in reqs:
        out = r.output_token_ids
        counts[out[1], out[2]] += 1
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks
    assert totals["drafted"] >= NUM_SAMPLES  # about one round of up to k drafts per request
    assert 0.05 < totals["accepted"] / totals["drafted"] < 0.95, totals
    return counts


def p_value(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    expected = expected_probs.ravel() * counts.sum()
    observed = counts.ravel()
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


TARGET = bigram_table(V, seed=1)
DRAFT = perturbed(TARGET, seed=2)


def build(method):
    target = BigramLM(TARGET)
    if method == "ngram":
        return target, NgramDrafter(1, 3)
    return target, ModelDrafter(BigramLM(DRAFT), 1, 3000, 16, torch.float32, torch.device("cpu"), 0.1)


@pytest.mark.parametrize("settings", SETTINGS, ids=["t1.0", "t0.7-p0.9"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_bigram_rounds_emit_target_distribution(method, settings):
    engine = make_engine(*build(method))
    counts = sample_joint(engine, settings)
    assert p_value(counts, exact_joint(lambda s: TARGET[s].numpy(), settings)) > 1e-3


def _resample_from_p(p, q):
    """The classic bug: after a rejection, sample from p instead of the residual."""
    return p


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_the_distribution_test_rejects_a_broken_sampler(method, monkeypatch):
    monkeypatch.setattr(rejection_sampler, "residual_distribution", _resample_from_p)
    engine = make_engine(*build(method))
    counts = sample_joint(engine, SETTINGS[0])
    assert p_value(counts, exact_joint(lambda s: TARGET[s].numpy(), SETTINGS[0])) < 1e-3


# ---- early exit: a tiny multi-layer Llama whose first layer drafts for it ----


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig

    from engine.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    for name, param in model.named_parameters():
        # Later layers get smaller weights, so the first layer alone is a fair draft.
        std = 0.5 if "embed" in name or "lm_head" in name else 0.3 if "layers.0." in name else 0.25
        torch.nn.init.normal_(param, std=std)
        if "norm" in name:
            torch.nn.init.ones_(param)
    return model.eval()


@torch.inference_mode()
def llama_next_probs(model, tokens: list[int]) -> np.ndarray:
    """The model's next-token distribution after ``tokens``, from one fresh prefill."""
    from engine.attention import SeqSpec, build_attention_metadata
    from engine.models.llama import head_dim_of
    from kvcache.tensors import KVSpec, PagedKV

    cfg = model.config
    kv = PagedKV(KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), 16, torch.float32), 4, "cpu")
    meta = build_attention_metadata([SeqSpec(0, len(tokens), [0, 1, 2, 3])], 16)
    hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), meta, kv)
    return model.compute_logits(hidden[-1:]).softmax(-1)[0].double().numpy()


def exact_llama_joint(model, settings) -> np.ndarray:
    joint = np.zeros((V, V))
    p0 = processed(llama_next_probs(model, PROMPT), **settings)
    for a0 in range(V):
        if p0[a0] == 0:
            continue
        p1 = processed(llama_next_probs(model, PROMPT + [a0]), **settings)
        for a1 in range(V):
            if p1[a1] > 0:
                joint[a1] += p0[a0] * p1[a1] * processed(llama_next_probs(model, PROMPT + [a0, a1]), **settings)
    return joint


@pytest.mark.parametrize("settings", SETTINGS, ids=["t1.0", "t0.7-p0.9"])
def test_early_exit_rounds_emit_target_distribution(settings):
    target = tiny_llama()
    counts = sample_joint(make_engine(target, None), settings)
    assert p_value(counts, exact_llama_joint(target, settings)) > 1e-3


def test_early_exit_test_rejects_a_broken_sampler(monkeypatch):
    monkeypatch.setattr(rejection_sampler, "residual_distribution", _resample_from_p)
    target = tiny_llama()
    counts = sample_joint(make_engine(target, None), SETTINGS[0])
    assert p_value(counts, exact_llama_joint(target, SETTINGS[0])) < 1e-3
