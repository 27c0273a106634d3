"""Token trees as plain data: a parent list and the indices derived from it.

A tree of ``n`` drafted tokens is ``parents``: ``parents[i]`` is the index of
node ``i``'s parent, -1 for a child of the last committed token (the root).
Parents come before their children. A chain is ``(-1, 0, 1, ...)``. Example::

    parents  (-1, -1, 0, 0, 1, 2)          root
    depth    ( 0,  0, 1, 1, 1, 2)         /    \\
                                         0      1
    children of the root: [0, 1]        / \\     |
    children of node 0:   [2, 3]       2   3    4
    rank (among siblings) (0, 1, 0, 1, 0, 0)    |
                                       5

Verification rows follow the runner: row 0 is the target's distribution after
the last committed token (the root), row ``i + 1`` the one after node ``i``.
Siblings are tried in node order, so a drafter lists its best guess first.
"""

import numpy as np

NO_CHILD = -1


def chain(n: int) -> tuple[int, ...]:
    return tuple(range(-1, n - 1))


def is_chain(parents: tuple[int, ...] | None) -> bool:
    return parents is None or tuple(parents) == chain(len(parents))


def depths(parents: tuple[int, ...]) -> np.ndarray:
    """[n] depth of each node below the root (0 for the root's children)."""
    depth = np.zeros(len(parents), dtype=np.int64)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parent {p} of node {i} must be -1 or an earlier node")
        depth[i] = depth[p] + 1 if p >= 0 else 0
    return depth


def ranks(parents: tuple[int, ...]) -> np.ndarray:
    """[n] rank of each node among its siblings (0 = tried first)."""
    seen: dict[int, int] = {}
    out = np.zeros(len(parents), dtype=np.int64)
    for i, p in enumerate(parents):
        out[i] = seen.get(p, 0)
        seen[p] = out[i] + 1
    return out


def children_table(parents: tuple[int, ...], width: int) -> np.ndarray:
    """[n + 1, width] children by verification row (row 0: the root's, row ``i + 1``:
    node ``i``'s), in sibling order, ``NO_CHILD`` padded. ``width`` >= the most children."""
    table = np.full((len(parents) + 1, width), NO_CHILD, dtype=np.int64)
    for i, (p, r) in enumerate(zip(parents, ranks(parents))):
        table[p + 1, r] = i
    return table


def max_children(parents: tuple[int, ...]) -> int:
    return int(ranks(parents).max()) + 1 if len(parents) else 0


def path(parents: tuple[int, ...], node: int) -> list[int]:
    """Nodes from the root's child down to ``node`` (empty for -1, the root)."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def path_tokens(token_ids: list[int], parents: tuple[int, ...] | None, num_nodes: int) -> list[list[int]]:
    """Per verification row ``0 .. num_nodes``: the drafted tokens on the branch before
    it (row 0: none; row ``i + 1``: the path to node ``i``)."""
    if is_chain(parents):
        return [list(token_ids[:r]) for r in range(num_nodes + 1)]
    return [[]] + [[token_ids[j] for j in path(parents, i)] for i in range(num_nodes)]


def merge_paths(paths: list[list[int]], max_nodes: int) -> tuple[list[int], tuple[int, ...]]:
    """The prefix tree of token sequences, earlier sequences first (so their nodes rank
    first among siblings), cut at ``max_nodes`` nodes. Returns ``(token_ids, parents)``.

    >>> merge_paths([[5, 6, 7], [5, 8], [9]], 10)
    ([5, 6, 7, 8, 9], (-1, 0, 1, 0, -1))
    """
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for seq in paths:
        parent = -1
        for t in seq:
            node = index.get((parent, t))
            if node is None:
                if len(tokens) >= max_nodes:
                    break
                node = index[(parent, t)] = len(tokens)
                tokens.append(t)
                parents.append(parent)
            parent = node
    return tokens, tuple(parents)


def order_by_depth(token_ids: list[int], parents: tuple[int, ...]) -> tuple[list[int], tuple[int, ...], list[int]]:
    """The same tree with nodes listed depth by depth (siblings kept in order), the form
    model drafters grow; returns ``(token_ids, parents, order)`` with ``order[new] = old``."""
    d = depths(parents)
    order = sorted(range(len(parents)), key=lambda i: (d[i], i))
    new_of = {old: new for new, old in enumerate(order)}
    return [token_ids[i] for i in order], tuple(new_of[parents[i]] if parents[i] >= 0 else -1 for i in order), order


def parse_static_tree(literal: list[tuple[int, ...]]) -> tuple[int, ...]:
    """vLLM's ``speculative_token_tree``: one tuple per node, the sibling ranks on the way
    from the root, e.g. ``[(0,), (1,), (0, 0), (0, 1), (1, 0)]``. Returns the parent list,
    nodes in the literal's order, which must list every node after its parent and each
    sibling after the one ranked before it.

    >>> parse_static_tree([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    (-1, -1, 0, 0, 1)
    """
    index: dict[tuple[int, ...], int] = {(): -1}
    parents = []
    for i, node in enumerate(literal):
        node = tuple(int(r) for r in node)
        if not node or node in index:
            raise ValueError(f"speculative_token_tree: node {i} {node} is empty or repeated")
        if node[:-1] not in index or (node[-1] > 0 and node[:-1] + (node[-1] - 1,) not in index):
            raise ValueError(f"speculative_token_tree: node {node} comes before its parent or elder sibling")
        index[node] = i
        parents.append(index[node[:-1]])
    return tuple(parents)


def widths_of(parents: tuple[int, ...]) -> list[list[int]]:
    """Per depth, the number of children each node of the level above gets in a static
    tree (the root first). Used by model drafters to grow a static tree depth by depth."""
    d = depths(parents)
    out: list[list[int]] = []
    for level in range(int(d.max()) + 1 if len(parents) else 0):
        above = [-1] if level == 0 else [i for i in range(len(parents)) if d[i] == level - 1]
        out.append([sum(1 for p in parents if p == a) for a in above])
    return out


def batch_children(trees: list[tuple[int, ...]], max_nodes: int) -> np.ndarray:
    """[n, max_nodes + 1, W] ``children_table`` of each request's tree, padded with
    ``NO_CHILD`` (W: the most children of any node in the batch; at least 1)."""
    width = max([max_children(p) for p in trees] + [1])
    out = np.full((len(trees), max_nodes + 1, width), NO_CHILD, dtype=np.int64)
    tables: dict[tuple[int, ...], np.ndarray] = {}
    for i, p in enumerate(trees):
        if p not in tables:
            tables[p] = children_table(p, width)
        out[i, : len(p) + 1] = tables[p]
    return out
