"""Token-tree shapes for the speculation policy (``engine.spec_decode.policy``). No torch.

A round's tree shape is a *template* (``engine.utils.tree`` parent list): the largest
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
``N`` nodes and depth ``D`` costs ``V(N) + D * c`` (``V`` from ``T(R)``, as for a
chain of ``N`` drafts; ``c`` per drafting pass, one per depth); the policy keeps
whichever of the chains and the candidate trees gives the most tokens per cost,
so a tree that does not pay is never used.

Without a static tree the candidates are grown (``grown``, as EAGLE-2 and Sequoia
shape theirs): the nodes are taken best first by that probability, a node's first
child and next sibling becoming candidates once it is taken, so every ``N`` first
nodes form a tree, the one of ``N`` nodes with the most expected accepted drafts
(a node never beats its parent, nor its elder sibling unless a younger rank's
record is better). The rank-0 chain is among them: a tree is its best chain plus
the side branches that pay, so it is never shallower than that chain where its
siblings are worth nothing.
"""

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from engine.utils import tree

# Acceptance assumed for a rank >= 1 child before any record: side branches of the EAGLE-3
# head and of prompt lookup are accepted 10-20% of the time on chat; a higher prior grows
# side branches that do not pay.
PRIOR_SIBLING = 0.12


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


def grown(
    rank0: list[float], siblings: list[list[float]], max_depth: int, width: int, max_nodes: int
) -> tuple[tuple[int, ...], list[float]]:
    """Up to ``max_nodes`` nodes of depth < ``max_depth`` and rank < ``width``, best first:
    ``(template, P(node on the accepted path) per node)``; each prefix is a tree."""
    parents: list[int] = []
    values: list[float] = []
    # (-value, order, parent, depth, rank, P(parent on path) * P(elder siblings rejected))
    frontier = [(-rate(rank0, siblings, 0, 0), 0, -1, 0, 0, 1.0)]
    pushed = 1
    while frontier and len(parents) < max_nodes:
        neg, _, parent, d, r, base = heapq.heappop(frontier)
        node, value = len(parents), -neg
        parents.append(parent)
        values.append(value)
        if d + 1 < max_depth:
            heapq.heappush(frontier, (-value * rate(rank0, siblings, d + 1, 0), pushed, node, d + 1, 0, value))
            pushed += 1
        if r + 1 < width:
            rest = base * (1 - rate(rank0, siblings, d, r))
            heapq.heappush(frontier, (-rest * rate(rank0, siblings, d, r + 1), pushed, parent, d, r + 1, rest))
            pushed += 1
    return tuple(parents), values


def best_grown(
    rank0: list[float], siblings: list[list[float]], max_depth: int, width: int, verify: list[float], draft: float
) -> tuple[tuple[int, ...], float]:
    """``(template, tokens per cost)`` of the best first ``N`` nodes of ``grown``, N from 1
    to ``len(verify) - 1``. A round of N nodes and depth D costs ``verify[N] + D * draft``:
    a model drafter runs one batched pass per depth (``drafters.tree_drafting``), and at
    the few rows of a tree a pass costs about the same whatever its width. With a drafting
    cost, trees are grown under each depth limit up to ``max_depth`` (a shallower, wider
    tree may pay more than the deep branch that the best-first order reaches first)."""
    top: tuple[tuple[int, ...], float] = ((), 0.0)
    for limit in range(1, max_depth + 1) if draft > 0 else (max_depth,):
        template, values = grown(rank0, siblings, limit, width, len(verify) - 1)
        depths = tree.depths(template)
        accepted, depth = 0.0, 0
        for n, v in enumerate(values, start=1):
            accepted += v
            depth = max(depth, int(depths[n - 1]) + 1)
            gain = (1 + accepted) / (verify[n] + depth * draft)
            if gain > top[1] + 1e-12:
                top = (template[:n], gain)
    return top


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
    """Moves the records towards one round's ``outcomes`` (``engine.utils.tree.walk``: per depth
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
