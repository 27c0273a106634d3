"""A step's drafts for verification, flat (vLLM v1's ``SpecDecodeMetadata`` is the model).

``n`` requests sample this step; request ``r`` drafted ``k_r >= 0`` tokens (a chain,
or a tree over them: ``engine.utils.tree``), ``D = sum k_r`` in all. The target pass gives
``R = D + n`` rows of logits, request after request: ``k_r + 1`` rows each, the
first after the last committed token, row ``i + 1`` after draft ``i``. Example::

    request   r0 (k=2)    r1 (k=0)   r2 (k=3, tree (-1, -1, 0))
    rows      0  1  2     3          4  5  6  7
    drafts    0  1                   2  3  4
    cu_num_draft_tokens = [2, 2, 5]        first_rows = [0, 3, 4]
    target_logits_indices = [0, 1, 4, 4, 5]  (each draft's parent's row)

Nothing is padded to the longest request: the verification rules work on these
offsets (``engine.spec_decode.rejection_sampler``, ``engine.spec_decode.tree_sampler``).
"""

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from engine.utils import tree
from engine.utils.transfer import to_device


@dataclass(frozen=True)
class VerifyMetadata:
    num_draft_tokens: torch.Tensor  # [n] long: k_r
    cu_num_draft_tokens: torch.Tensor  # [n] long, inclusive: request r's drafts are [cu[r] - k_r, cu[r])
    draft_token_ids: torch.Tensor  # [D] long
    request_index: torch.Tensor  # [D] long: the request of each draft
    target_logits_indices: torch.Tensor  # [D] long: the row each draft is checked against (its parent's)
    first_rows: torch.Tensor  # [n] long: each request's first row (after its last committed token)
    draft_probs: torch.Tensor | None  # [D, V] q of each draft (one-hot for deterministic ones); None: all one-hot
    children: torch.Tensor | None  # [R, W] long: draft index of each row's children, -1 padded; None: all chains
    max_num_draft_tokens: int
    max_depth: int = 0  # levels of the deepest draft tree (a chain's: its num_draft_tokens), for loops with no host sync

    @property
    def num_requests(self) -> int:
        return self.num_draft_tokens.shape[0]

    @property
    def draft_starts(self) -> torch.Tensor:
        """[n] the flat index of each request's first draft (``cu[r] - k_r``)."""
        return self.cu_num_draft_tokens - self.num_draft_tokens

    def draft_rows(self) -> torch.Tensor:
        """[D] the row computed at each draft (its children are checked against it)."""
        return torch.arange(len(self.draft_token_ids), device=self.draft_token_ids.device) + self.request_index + 1


def build_verify_metadata(
    token_ids: list[list[int]],
    parents: list[tuple[int, ...] | None],
    probs: list[torch.Tensor | None],
    vocab_size: int,
    device="cpu",
    with_children: bool | None = None,
) -> VerifyMetadata:
    """From each request's drafts (possibly none), their trees (None: a chain) and q
    (``[k_r, vocab]``, None: deterministic) -> the flat metadata on ``device``.
    ``children`` is built when some draft is a tree that is not a chain (``with_children``
    None), or as ``with_children`` says."""
    num = np.array([len(t) for t in token_ids], dtype=np.int64)  # [n] num_draft_tokens
    cu = np.cumsum(num)
    first = cu - num + np.arange(len(num))  # each request's first row
    shapes = [tuple(p) if p is not None else tree.chain(len(t)) for t, p in zip(token_ids, parents)]
    request_index = np.repeat(np.arange(len(num)), num)
    local_parents = np.fromiter(itertools.chain.from_iterable(shapes), dtype=np.int64, count=int(num.sum()))  # [D]
    target = first[request_index] + local_parents + 1
    to = lambda a: to_device(np.asarray(a, dtype=np.int64), device)  # noqa: E731
    flat_ids = [t for ids in token_ids for t in ids]
    trees = any(p is not None and not tree.is_chain(p) for p in parents) if with_children is None else with_children
    return VerifyMetadata(
        num_draft_tokens=to(num),
        cu_num_draft_tokens=to(cu),
        draft_token_ids=to(flat_ids),
        request_index=to(request_index),
        target_logits_indices=to(target),
        first_rows=to(first),
        draft_probs=_stack_probs(flat_ids, probs, num, vocab_size, device),
        children=to(_children(shapes, first, cu - num)) if trees else None,
        max_num_draft_tokens=int(num.max()) if len(num) else 0,
        max_depth=max((len(s) if p is None else int(tree.depths(s).max()) + 1
                       for s, p in zip(shapes, parents) if s), default=0),
    )


def _stack_probs(flat_ids: list[int], probs, num_draft_tokens: np.ndarray, vocab_size: int,
                 device) -> torch.Tensor | None:
    """q [D, V]: a draft's own ``probs`` where its request has them, one-hot at the drafted
    token where it has none (a deterministic drafter). None when no request has probs:
    the samplers then take every q as one-hot themselves."""
    if not any(p is not None for p in probs):
        return None
    q = torch.zeros(len(flat_ids), vocab_size, device=device)
    q[torch.arange(len(flat_ids), device=device), to_device(flat_ids, device, torch.long)] = 1.0
    start = np.cumsum(num_draft_tokens) - num_draft_tokens
    for p, s, n in zip(probs, start, num_draft_tokens):
        if p is not None:
            q[s : s + n] = p
    return q


def _children(trees: list[tuple[int, ...]], first: np.ndarray, draft_start: np.ndarray) -> np.ndarray:
    """[R, W] the draft index of each row's children, in sibling order, -1 padded: each
    request's ``tree.children_table`` at its rows, its node indices made flat."""
    width = max([tree.max_children(p) for p in trees] + [1])
    out = np.full((int(first[-1]) + len(trees[-1]) + 1, width), tree.NO_CHILD, dtype=np.int64)
    tables: dict[tuple[int, ...], np.ndarray] = {}
    for p, row, start in zip(trees, first, draft_start):
        if p not in tables:
            tables[p] = tree.children_table(p, width)
        table = tables[p]
        out[row : row + len(p) + 1] = np.where(table >= 0, table + start, tree.NO_CHILD)
    return out
