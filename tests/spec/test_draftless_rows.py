"""A sampled row without drafts draws its token the same way whether a neighbour
drafted (the runner then verifies the whole batch) or not (the runner samples):
from p itself, with the same noise, so a seeded request's bits do not depend on
its batch. Near-ties in ``p / E`` are made on purpose: there, dividing p by its
sum (a residual against q = 0) moves the last bits and flips the token."""

import torch

from engine import SamplingParams
from engine.worker.sampler import build_sampling_batch, exponential_noise, processed_probs, sample
from engine.spec_decode.drafter import Draft
from engine.spec_decode.verify import verify

V = 8
NUM_ROWS = 400


class Row:
    def __init__(self, params: SamplingParams):
        self.params = params


def tied_logits(seed: int) -> torch.Tensor:
    """[V] logits whose two best tokens tie in ``p / E`` for the noise seed ``seed`` draws."""
    noise = exponential_noise((1, V), [torch.Generator().manual_seed(seed)], "cpu")[0]
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1000 + seed))
    score = logits - noise.log()
    a, b = score.topk(2).indices.tolist()
    logits[b] = logits[a] + noise[b].log() - noise[a].log()
    return logits


def alone(logits: torch.Tensor, seed: int) -> int:
    """The runner with no drafts in the step: ``sample``."""
    batch = build_sampling_batch([Row(SamplingParams(temperature=1.0, seed=seed))], V, "cpu",
                                 [torch.Generator().manual_seed(seed)])
    return sample(logits[None], batch).item()


def beside_a_drafter(logits: torch.Tensor, seed: int) -> int:
    """The runner when a neighbour drafted 2 tokens: ``verify`` over both requests, the seeded
    row's noise from its generator (it has no uniforms to draw first)."""
    neighbour = torch.randn(3, V, generator=torch.Generator().manual_seed(seed))
    rows = [Row(SamplingParams(temperature=1.0, seed=seed))] + [Row(SamplingParams(temperature=1.0))] * 3
    probs = processed_probs(torch.cat([logits[None], neighbour]), build_sampling_batch(rows, V, "cpu", [None] * 4))
    gens = [torch.Generator().manual_seed(seed), None]
    noise = exponential_noise((2, V), gens, "cpu")
    verdict = verify([None, Draft([1, 2])], [False, False], None, probs, torch.rand(2), noise)
    return verdict.tokens[0][0]


def test_a_draftless_sampled_row_draws_the_same_token_beside_a_drafting_neighbour():
    differ = [s for s in range(NUM_ROWS) if alone(tied_logits(s), s) != beside_a_drafter(tied_logits(s), s)]
    assert differ == []
