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

Plain data with no imports of the engine's: the configuration, the attention
backends (tree masks), speculation and the drafters all build on it.
"""

import numpy as np

NO_CHILD = -1


def chain(n: int) -> tuple[int, ...]:
    return tuple(range(-1, n - 1))


def is_chain(parents: tuple[int, ...] | None) -> bool:
    return parents is None or tuple(parents) == chain(len(parents))


def with_prefix(num_prefix: int, parents: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """The tree over a forward's fed tokens: ``num_prefix`` tokens as a chain, then the
    nodes of ``parents``, its roots hanging from the last prefix token.

    >>> with_prefix(2, (-1, -1, 0))
    (-1, 0, 1, 1, 2)
    """
    return chain(num_prefix) + tuple(p + num_prefix if p >= 0 else num_prefix - 1 for p in parents)


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


def leaf_paths(parents: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """``(path, own)`` per leaf, in node order of the leaves: ``path(parents, leaf)``, and the
    nodes of it on no earlier leaf's path (a suffix of it); every node is in exactly one ``own``.

    >>> leaf_paths((-1, 0, 0, 1))  # 0 - 1 - 3 and 0 - 2
    [([0, 2], [0, 2]), ([0, 1, 3], [1, 3])]
    """
    inner = set(parents)
    seen, out = set(), []
    for leaf in (i for i in range(len(parents)) if i not in inner):
        nodes = path(parents, leaf)
        own = [n for n in nodes if n not in seen]
        seen.update(own)
        out.append((nodes, own))
    return out


def path_tokens(token_ids: list[int], parents: tuple[int, ...] | None, num_nodes: int) -> list[list[int]]:
    """Per verification row ``0 .. num_nodes``: the drafted tokens on the branch before
    it (row 0: none; row ``i + 1``: the path to node ``i``)."""
    if is_chain(parents):
        return [list(token_ids[:r]) for r in range(num_nodes + 1)]
    return [[]] + [[token_ids[j] for j in path(parents, i)] for i in range(num_nodes)]


def merge_paths(
    paths: list[list[int]], max_nodes: int, widths: list[int] | None = None
) -> tuple[list[int], tuple[int, ...]]:
    """The prefix tree of token sequences, earlier sequences first (so their nodes rank
    first among siblings), cut at ``max_nodes`` nodes; ``widths[d]``: at most that many
    children per node at depth ``d`` (and no node deeper than ``len(widths)``); a
    sequence stops where it does not fit. Returns ``(token_ids, parents)``.

    >>> merge_paths([[5, 6, 7], [5, 8], [9]], 10)
    ([5, 6, 7, 8, 9], (-1, 0, 1, 0, -1))
    >>> merge_paths([[5, 6, 7], [5, 8], [9]], 10, widths=[2, 1])
    ([5, 6, 9], (-1, 0, -1))
    """
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    num_children: dict[int, int] = {}
    for seq in paths:
        parent = -1
        for depth, t in enumerate(seq):
            node = index.get((parent, t))
            if node is None:
                full = widths is not None and (depth >= len(widths) or num_children.get(parent, 0) >= widths[depth])
                if full or len(tokens) >= max_nodes:
                    break
                node = index[(parent, t)] = len(tokens)
                num_children[parent] = num_children.get(parent, 0) + 1
                tokens.append(t)
                parents.append(parent)
            parent = node
    return tokens, tuple(parents)


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


def max_widths(parents: tuple[int, ...]) -> list[int]:
    """Per depth, the most children any node of the level above has (the root's first).

    >>> max_widths((-1, -1, 0, 0, 1, 2))
    [2, 2, 1]
    """
    d = depths(parents)
    out = [0] * (int(d.max()) + 1 if len(parents) else 0)
    for rank, depth in zip(ranks(parents), d):
        out[depth] = max(out[depth], int(rank) + 1)
    return out


def product_tree(widths: list[int], max_nodes: int) -> tuple[int, ...]:
    """The tree where every node at depth ``d - 1`` (the root for d = 0) has ``widths[d]``
    children, listed depth by depth, cut at ``max_nodes`` nodes.

    >>> product_tree([2, 1], 10)
    (-1, -1, 0, 1)
    """
    parents: list[int] = []
    level = [-1]
    for w in widths:
        nxt = []
        for p in level:
            for _ in range(w):
                if len(parents) == max_nodes:
                    return tuple(parents)
                nxt.append(len(parents))
                parents.append(p)
        level = nxt
    return tuple(parents)


def walk(token_ids: list[int], parents: tuple[int, ...], accepted: list[int]) -> list[tuple[int, int | None]]:
    """What verification tried, read off the tree and the accepted tokens: per depth
    reached, ``(children tried, rank of the accepted child or None)``; a depth whose
    node has no children is not listed (nothing was tried there).

    >>> walk([5, 6, 7], (-1, -1, 0), [6])
    [(2, 1)]
    """
    table = children_table(parents, max_children(parents) or 1)
    out, row = [], 0
    for depth in range(len(accepted) + 1):
        kids = [c for c in table[row] if c >= 0]
        if not kids:
            break
        nxt = accepted[depth] if depth < len(accepted) else None
        rank = next((r for r, c in enumerate(kids) if token_ids[c] == nxt), None)
        out.append((len(kids) if rank is None else rank + 1, rank))
        if rank is None:
            break
        row = kids[rank] + 1
    return out
