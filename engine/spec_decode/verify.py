"""The verify step: which drafts each request keeps, and the one token after them.

Pure: it reads the target's rows for the drafts and returns tokens. The runner
runs the forward pass before it and moves the KV entries of accepted tree
paths after it (``ModelRunner._keep_accepted_paths``).

Rows are request after request, ``k_r + 1`` each (``engine.spec_decode.metadata``):
row 0 is the target after the last committed token, row ``i + 1`` the target
after draft ``i`` (after node ``i``'s branch, for a token tree). A request
without drafts has one row: the rules then give its row's token.

One rule per kind of request, chains and trees alike (a chain is a tree of width 1):

* greedy (``greedy_rule``): keep the longest root path of drafts whose every node
  is the target's argmax after its parent, then the argmax after the path's last
  node. It is the rejection rule with ``p`` one-hot at the argmax (tested so),
  computed on integers;
* sampled: the rejection rule, ``engine.spec_decode.rejection_sampler`` for chains
  and ``engine.spec_decode.tree_sampler`` for trees (the rules and their proofs).

A batch that mixes them sends each request to its own rule.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.utils import tree
from engine.spec_decode.drafter import Draft
from engine.spec_decode.metadata import build_verify_metadata
from engine.spec_decode.rejection_sampler import rejection_sample
from engine.spec_decode.tree_sampler import tree_verify
from engine.utils.transfer import to_device


@dataclass(frozen=True)
class Verified:
    """Per request, in the batch's order."""

    tokens: list[list[int]]  # the accepted drafts, then the recovered or bonus token
    paths: list[list[int]]  # the accepted drafts' node indices, root first (a chain's: 0 .. J-1)

    def emit_rows(self, i: int) -> list[int]:
        """The row (within request ``i``'s) that predicted each of its tokens."""
        return [0] + [n + 1 for n in self.paths[i]]


def greedy_rule(argmax: Sequence[int], drafts: Sequence[Draft | None]) -> Verified:
    """The greedy rule (module docstring) for every request. ``argmax`` [R]: the target's
    choice at each row."""
    tokens, paths, row = [], [], 0
    for d in drafts:
        ids = d.token_ids if d else ()
        parents = d.parents if d and d.parents is not None else tree.chain(len(ids))
        path = _greedy_path(ids, parents, argmax[row : row + len(ids) + 1])
        tokens.append([ids[n] for n in path] + [argmax[row + (path[-1] + 1 if path else 0)]])
        paths.append(path)
        row += len(ids) + 1
    return Verified(tokens, paths)


def _greedy_path(ids: Sequence[int], parents: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """The nodes from the root down while some child of the node reached is the target's
    argmax after it (``argmax[0]``: after the root, ``argmax[1 + i]``: after node i)."""
    path, node = [], -1
    while True:
        want = argmax[node + 1]
        child = next((i for i in range(node + 1, len(ids)) if parents[i] == node and ids[i] == want), None)
        if child is None:
            return path
        path.append(child)
        node = child


def verify(
    drafts: Sequence[Draft | None],
    greedy: Sequence[bool],  # [n] per request
    argmax: torch.Tensor | None,  # [R] the greedy choice per row; None when no request is greedy
    probs: torch.Tensor | None,  # [R, V] processed p per row; None when every request is greedy
    uniforms: torch.Tensor | None,  # [D_s] U[0, 1), one per draft of the sampled requests, in order
    noise: torch.Tensor | None,  # [n_s, V] Exp(1), one row per sampled request, in order
) -> Verified:
    """Every request's drafts verified at once: the greedy requests by ``greedy_rule``, the
    sampled ones by the rejection rule. What the host needs reaches it in one copy (one
    sync on a GPU)."""
    sampled = [i for i, g in enumerate(greedy) if not g]
    if not sampled:
        return greedy_rule(argmax.tolist(), drafts)
    mixed = len(sampled) < len(drafts)
    if mixed:
        probs = probs[to_device(_rows(drafts, sampled), probs.device, torch.long)]
    found = _sampled_rule([drafts[i] for i in sampled], probs, uniforms, noise)
    argmax_list, out, accepted, nodes = _to_host([argmax if mixed else None, *found])
    paths = [[x for x in row if x >= 0] for row in nodes] if nodes is not None else [list(range(j)) for j in accepted]
    verdict = Verified([row[: len(p) + 1] for row, p in zip(out, paths)], paths)
    if not mixed:
        return verdict
    chosen = [i for i, g in enumerate(greedy) if g]
    parts = [(chosen, greedy_rule([argmax_list[r] for r in _rows(drafts, chosen)], [drafts[i] for i in chosen])),
             (sampled, verdict)]
    tokens, paths = [[]] * len(drafts), [[]] * len(drafts)
    for idx, part in parts:
        for j, i in enumerate(idx):
            tokens[i], paths[i] = part.tokens[j], part.paths[j]
    return Verified(tokens, paths)


def _rows(drafts: Sequence[Draft | None], idx: Sequence[int]) -> list[int]:
    """The rows of requests ``idx`` (``k_r + 1`` each, request after request), in order."""
    sizes = np.array([1 + (len(d.token_ids) if d else 0) for d in drafts])  # [n] rows per request
    ends = np.cumsum(sizes)
    return [r for i in idx for r in range(ends[i] - sizes[i], ends[i])]


def _sampled_rule(drafts: Sequence[Draft | None], probs: torch.Tensor, uniforms: torch.Tensor,
                  noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The rejection rule over sampled requests only, on the device. probs [R, V] of their
    rows. Returns (output_ids [n, L + 1], num_accepted [n], accepted_nodes [n, L] or None
    for chains), rows padded with PLACEHOLDER."""
    meta = build_verify_metadata([d.token_ids if d else [] for d in drafts], [d.parents if d else None for d in drafts],
                                 [d.probs if d else None for d in drafts], probs.shape[1], probs.device)
    if meta.children is not None:
        return tree_verify(meta, probs, uniforms, noise)
    return (*rejection_sample(probs, meta, uniforms, noise), None)


def _to_host(tensors: list[torch.Tensor | None]) -> list:
    """Integer tensors (1-D or 2-D; None passes) as host lists, in one copy (one sync on a GPU)."""
    flat = torch.cat([t.reshape(-1).long() for t in tensors if t is not None]).tolist()
    out, start = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        part, start = flat[start : start + t.numel()], start + t.numel()
        width = t.shape[1] if t.dim() == 2 else None
        out.append(part if width is None else [part[i * width : (i + 1) * width] for i in range(t.shape[0])])
    return out
