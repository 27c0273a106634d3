"""The distribution tests' own tools: deterministic bigram tables, an
independent processed distribution that agrees with engine.worker.sampler, and a
chi-square check that an impossible outcome fails outright."""

import numpy as np
import torch

from engine.core.request import Request
from engine.worker.sampler import build_sampling_batch, penalized_logits, processed_probs
from engine.sampling_params import SamplingParams
from tests.spec.bigram import bigram_table, perturbed
from tests.spec.distribution import p_value, processed


def test_bigram_tables_are_a_function_of_their_seed_alone():
    torch.manual_seed(1)
    first = bigram_table(6, seed=3), perturbed(bigram_table(6, seed=3), seed=4)
    torch.manual_seed(2)
    torch.rand(100)  # the global generator somewhere else entirely
    again = bigram_table(6, seed=3), perturbed(bigram_table(6, seed=3), seed=4)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(bigram_table(6, seed=3), bigram_table(6, seed=5))
    assert torch.allclose(first[0].sum(1), torch.ones(6))


def test_an_observed_impossible_outcome_fails_the_chi_square_outright():
    expected = np.array([0.5, 0.3, 0.2, 0.0])
    exact = np.array([5000.0, 3000.0, 2000.0, 0.0])  # the expected counts, to the sample
    assert p_value(exact, expected) > 0.99
    one_impossible = exact + [0, -1, 0, 1]
    assert p_value(one_impossible, expected) == 0.0
    # The same single sample in a possible but rare cell is well within chance.
    rare = np.array([0.5, 0.3, 0.2 - 1e-4, 1e-4])
    assert p_value(one_impossible, rare) > 0.5


def test_a_point_mass_is_checked_by_where_it_lies():
    point = np.array([0.0, 1.0, 0.0])
    assert p_value(np.array([0.0, 100.0, 0.0]), point) == 1.0
    assert p_value(np.array([1.0, 99.0, 0.0]), point) == 0.0


SETTINGS = [
    dict(temperature=0.8, top_k=3, min_p=0.2),
    dict(temperature=1.3, top_p=0.7, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
    dict(temperature=0.6, logit_bias={2: 1.5, 4: -3.0}, min_p=0.05),
    dict(temperature=0.0, repetition_penalty=2.0, logit_bias={1: -1.0}),
]


def test_the_independent_processed_distribution_agrees_with_the_sampler():
    gen = torch.Generator().manual_seed(0)
    prompt, output = [0, 1, 5], [1, 1, 3]
    for settings in SETTINGS:
        for _ in range(20):
            logits = torch.randn(1, 6, generator=gen) * 2
            req = Request("r", prompt, SamplingParams(**settings), frozenset())
            req.token_ids.extend(output)
            batch = build_sampling_batch([req], 6, "cpu", [None])
            if settings["temperature"] == 0:
                engine = np.eye(6)[int(penalized_logits(logits, batch).argmax())]
            else:
                engine = processed_probs(logits, batch)[0].double().numpy()
            mine = processed(logits[0].double().numpy(), settings, prompt + output, output)
            np.testing.assert_allclose(mine, engine, atol=1e-5)
