"""``draw_children`` draws a node's children exactly as the q it reports, even where q
holds float32 denormals, and never draws a token q gives no mass: sequential draws
without replacement, checked by chi-square against the exact probabilities."""

import numpy as np
import torch

from drafters import tree_drafting
from drafters.tree_drafting import draw_children
from tests.spec.distribution import p_value

V = 8
TINY = 2.0**-149  # the smallest float32 denormal
NUM_DRAWS = 2000
# Power, fixed in advance: a race of q / E in float32 draws the (second, third) children
# of WEIGHTS at a total variation of 0.10 from the exact pairs (a noncentrality of 0.052
# per draw, measured over 20,000 draws); at 2,000 draws the chi-square over the 6 cells
# rejects it at p < 1e-3 with probability > 0.999 (noncentral chi-square, lambda = 104,
# critical value 20.5 at 5 degrees of freedom).
WEIGHTS = {1: 4, 2: 2, 3: 2}  # q = 1 at token 0, then these multiples of TINY


def tiny_q(weights: dict[int, int]) -> torch.Tensor:
    q = torch.zeros(V)
    q[0] = 1.0
    for t, w in weights.items():
        q[t] = w * TINY
    return q


def draws(q: torch.Tensor, count: int, seed: int = 0) -> list[list[tuple[int, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return [draw_children(q, q.log(), False, count, torch.empty(V).exponential_(generator=g)) for _ in range(NUM_DRAWS)]


def test_children_of_a_denormal_q_are_drawn_from_the_q_they_report():
    q = tiny_q(WEIGHTS)
    total = sum(WEIGHTS.values())
    exact = np.zeros((V, V))
    for a, wa in WEIGHTS.items():
        for b, wb in WEIGHTS.items():
            if a != b:
                exact[a, b] = wa / total * wb / (total - wa)
    counts = np.zeros((V, V))
    for kids in draws(q, 3):
        (first, _), (second, q2), (third, q3) = kids
        assert first == 0 and second in WEIGHTS and third in WEIGHTS
        counts[second, third] += 1
        # The q each child reports is q without its elder siblings, renormalized.
        assert abs(float(q2[second]) - WEIGHTS[second] / total) < 1e-6
        assert abs(float(q3[third]) - WEIGHTS[third] / (total - WEIGHTS[second])) < 1e-6
    assert p_value(counts, exact) > 1e-3


def test_a_token_without_mass_is_never_drawn():
    q = tiny_q({1: 1, 2: 1})  # every positive q / E below 1 underflows to 0 in float32
    for kids in draws(q, 4):
        assert len(kids) == 3  # q's support: no more children than that
        for token, q_i in kids:
            assert q[token] > 0 and q_i[token] > 0


def test_a_depth_of_chains_draws_each_row_as_draw_children_would():
    """``draw`` takes every row at once where each has one child: the same token per row as
    ``draw_children`` alone (so a row never depends on the others), and the same q."""
    g = torch.Generator().manual_seed(1)
    q = torch.softmax(torch.randn(6, V, generator=g) * 3, -1)
    q[2] = tiny_q({1: 1, 2: 3})  # denormal mass
    q[3, 4:] = 0.0  # top-k'd
    q[3] /= q[3].sum()
    logits, noise = torch.randn(6, V, generator=g), torch.empty(6, V).exponential_(generator=g)
    greedy = [False, True, False, False, True, False]
    together = tree_drafting.draw(q, logits, greedy, [1] * 6, noise)
    for r in range(6):
        [(token, q_r)] = together[r]
        [(alone, q_alone)] = draw_children(q[r], logits[r], greedy[r], 1, noise[r])
        assert token == alone and (q_r is None) == (q_alone is None) == greedy[r]
        if q_r is not None:
            assert torch.allclose(q_r, q_alone, rtol=1e-6, atol=0) and q[r, token] > 0
