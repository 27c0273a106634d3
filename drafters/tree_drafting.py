"""Growing token trees with a model drafter, depth by depth, inside a template.

The policy hands each slot a template (``DraftSlot.shape``, an ``engine.utils.tree``
parent list chosen before drafting; a slot without one drafts a chain, a tree of
width 1). The drafter runs one batched forward per depth over each request's
tree so far (while it is a chain, over its newest node only: the others are in
the cache) and draws the children of every node of the deepest level at once;
each node gets exactly the children its template node has, as many as can be drawn.

How children are drawn, so that verification (``engine.spec_decode.tree_sampler``) is exact:

* sampled request: without replacement from the draft's processed
  distribution ``q``, by one exponential race -- the tokens ordered by
  ``q(x) / E_x`` (``E_x ~ Exp(1)``) are sequential draws without replacement.
  The race and each child's ``q_i`` are computed in float64 and the race in log
  space, so a q of float32 denormals is drawn from as reported and a token with
  ``q = 0`` is never drawn (in float32, ``q / E`` of tiny q rounds or underflows).
  Child ``i`` is sent with ``q_i`` = ``q`` with children ``1 .. i-1`` zeroed and
  renormalized, the distribution it was really drawn from given its elder
  siblings (plain ``q`` per child would be wrong, see the tree sampler's proof).
  Tokens ``q`` gives no mass cannot be drawn: a node gets at most as many
  children as ``q`` has support (which depends on the branch, not on the draws);
* greedy request: the ``w`` best tokens by the draft's penalized logits, a
  function of the context alone, with no q (verification only compares
  argmaxes). Whether a round takes the plain-greedy fast path (the raw logits'
  top tokens) is decided once per round, for the whole batch.

The tree's shape never depends on a node's own token, only on the template
and on what was drawn before it, which keeps the round non-anticipating.
"""

import functools
from dataclasses import dataclass, field

import torch

from engine.spec_decode.drafter import Draft, DraftSlot
from engine.utils import tree


@dataclass
class GrowingTree:
    """One request's tree while it grows: nodes listed depth by depth."""

    slot: DraftSlot
    template: tuple[int, ...]  # the shape, cut to the slot's node budget
    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[torch.Tensor | None] = field(default_factory=list)  # [vocab] q_i per node; None: greedy (one-hot)
    of_template: list[int] = field(default_factory=list)  # template node of each node
    num_fed: int = 0  # nodes a forward has fed (their KV written), set by the forward
    depths: list[int] = field(default_factory=list)  # depth of each node (0: a root's child)
    kids: dict[int, list[int]] = field(default_factory=dict)  # template node (-1: the root) -> its children

    def __post_init__(self):
        for i, p in enumerate(self.template):
            self.kids.setdefault(p, []).append(i)

    def level(self, depth: int) -> list[int]:
        """The nodes at ``depth - 1`` whose children are drawn at ``depth`` (-1: the root)."""
        if depth == 0:
            return [-1]
        return [i for i, d in enumerate(self.depths) if d == depth - 1]

    def num_children(self, node: int) -> int:
        """Children of ``node``'s template node (-1: the root)."""
        return len(self.kids.get(self.of_template[node] if node >= 0 else -1, ()))

    def add(self, parent: int, rank: int, token: int, q: torch.Tensor | None) -> None:
        self.of_template.append(self.kids[self.of_template[parent] if parent >= 0 else -1][rank])
        self.depths.append(self.depths[parent] + 1 if parent >= 0 else 0)
        self.token_ids.append(token)
        self.parents.append(parent)
        self.probs.append(q)

    def unfed(self) -> tuple[int, tuple[int, ...]] | None:
        """While the tree is a chain: (first, parents) of the nodes not yet fed, ``first`` on,
        their parents counted from there (the fed nodes, every new node's ancestors, are read
        from the cache). None once it branches: a forward feeds the whole tree, under its mask."""
        parents = tuple(self.parents)
        if not tree.is_chain(parents):
            return None
        return self.num_fed, tree.chain(len(parents) - self.num_fed)

    def draft(self) -> Draft | None:
        if not self.token_ids:
            return None
        parents = tuple(self.parents)
        greedy = self.slot.request.params.greedy  # q is None at every node of a greedy request, at none of a sampled one
        probs = None if greedy else torch.stack(self.probs)  # [nodes, vocab]
        return Draft(list(self.token_ids), probs, None if tree.is_chain(parents) else parents)


def template_of(slot: DraftSlot) -> tuple[int, ...]:
    """The slot's template in depth order (as drafting grows it), cut to its node budget; a
    slot without a shape drafts a chain, a tree of width 1."""
    shape = slot.shape if slot.shape is not None else tree.chain(slot.num_draft_tokens)
    return _depth_ordered(tuple(shape[: slot.num_draft_tokens]))


@functools.lru_cache(maxsize=1024)
def _depth_ordered(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` renumbered in depth order (cached: a policy's few shapes recur every step)."""
    d = tree.depths(shape)
    order = sorted(range(len(shape)), key=lambda i: (d[i], i))
    new = {old: i for i, old in enumerate(order)}
    return tuple(new[shape[i]] if shape[i] >= 0 else -1 for i in order)


def draw_children(q: torch.Tensor, logits: torch.Tensor, greedy: bool, count: int, noise: torch.Tensor):
    """``count`` distinct children of one node (fewer if q's support is smaller): their
    tokens and the q each was drawn from (None for a greedy request). q, logits
    (penalized), noise: [vocab]."""
    if greedy:
        return [(t, None) for t in logits.topk(min(count, logits.shape[0])).indices.tolist()]
    q64 = q.double()
    keys = q64.log() - noise.double().log()  # log(q / E): no underflow; -inf exactly where q = 0
    tokens = keys.topk(min(count, int((q64 > 0).sum()))).indices.tolist()  # exponential race order
    out, rest = [], q64.clone()
    for t in tokens:
        out.append((t, (rest / rest.sum()).to(q.dtype)))
        rest[t] = 0.0
    return out


def draw(q: torch.Tensor, logits: torch.Tensor, greedy: list[bool], counts: list[int], noise: torch.Tensor):
    """The children of every row (``draw_children`` with its row's count): row by row, or, where
    every row has one child (a depth of chains), all rows at once. q, logits, noise: [rows, vocab]."""
    if any(c != 1 for c in counts):
        return [draw_children(q[r], logits[r], greedy[r], c, noise[r]) for r, c in enumerate(counts)]
    return [[child] for child in draw_only_children(q, logits, greedy, noise)]


def draw_only_children(q: torch.Tensor, logits: torch.Tensor, greedy: list[bool], noise: torch.Tensor):
    """``draw_children`` with a count of 1, every row at once: per row, its token and the q it
    was drawn from (None for a greedy row)."""
    q64 = q.double()
    race = (q64.log() - noise.double().log()).topk(1).indices[:, 0].tolist()  # [rows]: the race's winner
    best = logits.topk(1).indices[:, 0].tolist()  # [rows]: a greedy row's token
    sampled = [i for i, g in enumerate(greedy) if not g]
    q_sampled = dict(zip(sampled, (q64[sampled] / q64[sampled].sum(-1, keepdim=True)).to(q.dtype)))
    return [(best[i], None) if g else (race[i], q_sampled[i]) for i, g in enumerate(greedy)]


def grow_trees(slots: list[DraftSlot], forward, distributions, generator, device) -> dict[str, Draft]:
    """Trees for ``slots`` (each with a shape), one depth per batched forward.

    ``forward(trees, depth)`` -> per tree, raw logits [len(tree.level(depth)), vocab]
    after each node of that level (the root at depth 0); ``distributions(logits,
    requests, prefixes)`` -> (q, penalized logits), both [rows, vocab];
    ``generator(request)``: its torch.Generator or None."""
    from engine.worker.sampler import exponential_noise, plain_greedy

    grows = [GrowingTree(s, template_of(s)) for s in slots]
    # The fast path is the round's, not a depth's: a depth where only plain greedy trees
    # are left must still draw as the rest of the round did.
    fast = all(plain_greedy(g.slot.request.params) for g in grows)
    for depth in range(max(int(tree.depths(g.template).max()) for g in grows) + 1):
        live = [g for g in grows if any(g.num_children(n) for n in g.level(depth))]
        if not live:
            break
        levels = [g.level(depth) for g in live]
        logits = forward(live, depth)  # [rows, vocab]
        if fast:  # children: the raw logits' top tokens
            _add_top_children(live, levels, logits)
            continue
        requests = [g.slot.request for g, lv in zip(live, levels) for _ in lv]
        prefixes = [tuple(_branch(g, n)) for g, lv in zip(live, levels) for n in lv]
        q, penalized = distributions(logits, requests, prefixes)
        noise = exponential_noise(tuple(q.shape), [generator(r) for r in requests], device)
        _add_drawn_children(live, levels, q, penalized, noise)
    return {g.slot.request.request_id: g.draft() for g in grows if g.token_ids}


def _add_drawn_children(live: list[GrowingTree], levels: list[list[int]], q, penalized, noise) -> None:
    """Children of every node of ``levels``, drawn from its row of q and the penalized logits [rows, vocab]."""
    counts = [g.num_children(n) for g, level in zip(live, levels) for n in level]
    greedy = [g.slot.request.params.greedy for g, level in zip(live, levels) for _ in level]
    rows = iter(draw(q, penalized, greedy, counts, noise))
    for g, level in zip(live, levels):
        for node in level:
            for rank, (token, q_i) in enumerate(next(rows)):
                g.add(node, rank, token, q_i)


def _add_top_children(live: list[GrowingTree], levels: list[list[int]], logits: torch.Tensor) -> None:
    """Children of every node of ``levels`` for plain greedy requests: the ``w`` best tokens
    of its row of ``logits`` [rows, vocab], with no q (one-hot: verification compares
    argmaxes). The general path's softmax, noise and one-hot q over the vocabulary would
    cost nearly as much as the head pass itself."""
    most = max(g.num_children(n) for g, level in zip(live, levels) for n in level)
    top = logits.topk(min(most, logits.shape[-1])).indices.tolist()  # [rows, most]
    row = 0
    for g, level in zip(live, levels):
        for node in level:
            for rank, token in enumerate(top[row][: g.num_children(node)]):
                g.add(node, rank, token, None)
            row += 1


def _branch(g: GrowingTree, node: int) -> list[int]:
    return [g.token_ids[i] for i in tree.path(tuple(g.parents), node)]

