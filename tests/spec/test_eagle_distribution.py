"""Rounds drafted by an EAGLE head (random weights, on a tiny Llama), chains and token
trees, emit exactly the target's processed distribution, and the same test rejects a
sampler that resamples from p instead of the residual, and a tree sampler that does not
update the residual between siblings (it has power). See tests/spec/test_distribution.py."""

import pytest
import torch

from drafters.eagle import EagleDrafter
from engine.spec_decode import rejection_sampler, tree_sampler
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
from tests.spec.eagle_heads import random_head


TREE = {"tree_width": 3, "max_tree_nodes": 6}
# Tree runs draw 40,000 samples: with 20,000, the (fixed) random stream at T=0.7 / top-p 0.9
# gave p = 7e-4, where 40,000 and 80,000 gave 0.13 and 0.97 (no bias, one unlucky draw).
TREE_SAMPLES = 2 * NUM_SAMPLES


def count_trees(engine) -> list[int]:
    """A counter of the drafts proposed as token trees (not chains), kept up to date."""
    count, propose = [0], engine.speculator.drafter.propose

    def counted(slots):
        drafts = propose(slots)
        count[0] += sum(d.parents is not None for d in drafts.values())
        return drafts

    engine.speculator.drafter.propose = counted
    return count


def eagle_engine(kind: str, **tree):
    target = tiny_llama()
    head = random_head(target, kind, seed=3, draft_vocab=5 if kind == "eagle3" else None, std=0.5)
    return target, make_engine(target, EagleDrafter(head, 3000, 16, torch.float32, torch.device("cpu"), 0.1), **tree)


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
    monkeypatch.setattr(rejection_sampler, "residual_distribution", resample_from_p)
    target, engine = eagle_engine("eagle3")
    counts = sample_joint(engine, SETTINGS[1], NUM_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), SETTINGS[1])) < 1e-3


@pytest.mark.parametrize("settings", [0, 1], ids=["T1", "T0.7-topp0.9"])
@pytest.mark.slow  # 40,000 requests
@pytest.mark.timeout(3600)
def test_eagle_trees_emit_target_distribution(settings):
    target, engine = eagle_engine("eagle3", **TREE)
    trees = count_trees(engine)
    counts = sample_joint(engine, SETTINGS[settings], TREE_SAMPLES)
    assert trees[0] >= TREE_SAMPLES // 2
    assert p_value(counts, exact_joint(llama_logits(target), SETTINGS[settings])) > 1e-3


@pytest.mark.slow  # 40,000 requests
@pytest.mark.timeout(3600)
def test_the_eagle_tree_test_rejects_a_sampler_that_keeps_the_residual_between_siblings(monkeypatch):
    monkeypatch.setattr(tree_sampler, "residual_distribution", lambda r, q: r)  # every sibling tried against p
    target, engine = eagle_engine("eagle3", **TREE)
    counts = sample_joint(engine, SETTINGS[0], TREE_SAMPLES)
    assert p_value(counts, exact_joint(llama_logits(target), SETTINGS[0])) < 1e-3
