"""Token-tree shapes for the speculation policy (``engine.spec_decode.policy``). No torch.

A round's tree shape is a *template* (``engine.tree`` parent list): the largest
tree the drafter may propose. It is chosen before drafting, like a chain's
length, from the measured costs and the request's acceptance records, never from
the drafts (non-anticipating), so verification stays exact.

Records per depth ``d`` (per request and context class): the chain's
conditional rate ``rates[d]`` is rank 0's, P(the first child accepted | depth
``d`` reached); ``siblings[d][j - 1]`` is rank ``j``'s, P(child ``j`` accepted |
depth ``d`` reached, children ``0 .. j-1`` rejected). A node of depth ``d`` and
rank ``r`` is then on the accepted path with probability::

    P(parent on it) * (1 - a(d, 0)) * ... * (1 - a(d, r - 1)) * a(d, r)

and a round emits ``1 + sum`` of that over the nodes on average. A template of
``N`` nodes costs ``V(N) + N * c`` (``V`` from ``T(R)``, as for a chain of ``N``
drafts); the policy keeps whichever of the chains and the candidate trees gives
the most tokens per cost, so a tree that does not pay is never used.
"""

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations_with_replacement

from engine import tree

PRIOR_SIBLING = 0.25  # acceptance assumed for a rank >= 1 child before any record


def rate(rank0: list[float], siblings: list[list[float]], depth: int, rank: int) -> float:
    """``a(depth, rank)``; depths past the records take the deepest one's rate."""
    if rank == 0:
        return rank0[min(depth, len(rank0) - 1)]
    row = siblings[depth] if depth < len(siblings) else []
    return row[rank - 1] if rank - 1 < len(row) else PRIOR_SIBLING


@dataclass(frozen=True)
class Candidate:
    """A tree template with its per-node depth and sibling rank, computed once."""

    template: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]

    @classmethod
    def of(cls, template: tuple[int, ...]) -> "Candidate":
        return cls(template, tuple(tree.depths(template).tolist()), tuple(tree.ranks(template).tolist()))


def expected_accepted(c: Candidate, rank0: list[float], siblings: list[list[float]]) -> float:
    """Mean accepted drafts of a round with tree ``c`` (see the module docstring)."""
    on_path: list[float] = []
    for p, d, r in zip(c.template, c.depths, c.ranks):
        miss = 1.0
        for j in range(r):
            miss *= 1 - rate(rank0, siblings, d, j)
        on_path.append((on_path[p] if p >= 0 else 1.0) * miss * rate(rank0, siblings, d, r))
    return sum(on_path)


def candidates(max_depth: int, width: int, max_nodes: int, static: tuple[int, ...] | None) -> list[Candidate]:
    """The tree templates the policy weighs against chains: the static tree if one is
    configured, else the product trees of non-increasing widths (<= ``width``, at least
    one > 1) of depth <= ``max_depth`` with at most ``max_nodes`` nodes."""
    if static is not None:
        return [Candidate.of(static)]
    out = []
    for depth in range(1, max_depth + 1):
        for ws in combinations_with_replacement(range(width, 0, -1), depth):  # non-increasing
            shape = tree.product_tree(list(ws), max_nodes + 1)
            if ws[0] > 1 and len(shape) <= max_nodes:
                out.append(Candidate.of(shape))
    return out


def best(
    trees: list[Candidate], rank0: list[float], siblings: list[list[float]], cost: Callable[[int], float]
) -> tuple[tuple[int, ...] | None, float]:
    """``(template, tokens per cost)`` of the best candidate; ``(None, 0)`` for none."""
    top: tuple[tuple[int, ...] | None, float] = (None, 0.0)
    for c in trees:
        gain = (1 + expected_accepted(c, rank0, siblings)) / cost(len(c.template))
        if gain > top[1] + 1e-12:
            top = (c.template, gain)
    return top


def update(rank0: list[float], siblings: list[list[float]], outcomes, weight: float) -> int:
    """Moves the records towards one round's ``outcomes`` (``engine.tree.walk``: per depth
    reached, children tried and the accepted rank); returns the depths tested."""
    for d, (tried, accepted) in enumerate(outcomes):
        if d < len(rank0):
            rank0[d] += weight * ((accepted == 0) - rank0[d])
        while len(siblings) <= d:
            siblings.append([])
        row = siblings[d]
        for j in range(1, tried):
            while len(row) < j:
                row.append(PRIOR_SIBLING)
            row[j - 1] += weight * ((accepted == j) - row[j - 1])
    return min(len(outcomes), len(rank0))
