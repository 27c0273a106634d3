"""Metadata of the varlen backends: flash-attn 2.x's layout over the paged KV cache.

Requests are packed, not padded: a group of ``n`` requests is described by

    cu_seqlens_q  [n + 1] int32   query rows of request r: cu_seqlens_q[r] .. cu_seqlens_q[r + 1]
    cu_seqlens_k  [n + 1] int32   KV length of request r: cu_seqlens_k[r + 1] - cu_seqlens_k[r]
    block_table   [n, max_blocks] int32, position p of request r at
                  slot block_table[r, p // block_size] * block_size + p % block_size

Example (block_size 4): r0 a chain of 2 after 3 cached tokens, blocks [1, 0];
r1 a decode after 4, blocks [2, 9]. cu_seqlens_q = [0, 2, 3], cu_seqlens_k =
[0, 5, 10], block_table = [[1, 0], [2, 9]]. With ``causal`` the mask is aligned
bottom-right (flash-attn >= 2.1): query row i of a request sees KV positions
0 .. kv_len - query_len + i, which for a chain or a prefill chunk is exactly its
context plus its new tokens up to itself.

Token trees (``SeqSpec.parents``) cannot be written as one causal mask, so they
are split in two parts merged by log-sum-exp (``engine.attention.lse``):

- ``tree_prefixes``: every tree node against the committed context only
  (``kv_len = context_len``, not causal: all of it is visible);
- ``tree``: every node against the tree's own new tokens, with the tree mask
  (a small dense attention over the step's new K/V, ``TreePart``).

Sliding windows (``window``: a query at position p sees positions p - window + 1 .. p)
are flash-attn's ``window_size=(window - 1, 0)`` on the causal groups. A tree node
at depth d (position context + d) sees the committed positions from context + d -
window + 1 on: with a window, ``tree_prefixes`` holds one group per depth, each node
its own one-row query over the context with ``window_left = window - 2 - d`` (a node
deeper than that sees no committed key and is left out: its prefix part is empty).
"""

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from engine.attention.metadata import MAX_BATCHED_QUERY, SeqSpec, tree_mask, window_binds, window_mask
from engine.utils.tree import depths
from engine.utils.transfer import to_device
from kvcache.manager import slot_mapping


@dataclass
class VarlenGroup:
    """Query rows attended by one kernel call, in flash-attn's varlen layout."""

    token_index: torch.Tensor | None  # [num_q] flat step token of each query row; None: all, in order
    cu_seqlens_q: torch.Tensor  # [n + 1] int32
    cu_seqlens_k: torch.Tensor  # [n + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [n, max_blocks] int32; max_blocks * block_size >= max_seqlen_k
    causal: bool  # bottom-right aligned causal mask; False: every key up to kv_len is visible
    # Query row i of a request (kv_len keys, q_len rows) also sees only keys from
    # kv_len - q_len + i - window_left on (flash-attn's window_size[0]); -1: no limit.
    window_left: int = -1


@dataclass
class TreePart:
    """The trees' nodes against each other: requests padded to ``max_m`` nodes."""

    token_index: torch.Tensor  # [n, max_m] flat step token of each node (padding repeats the last)
    mask: torch.Tensor  # [n, max_m, max_m] bool, the tree mask (padding rows copy the last row)
    valid_rows: torch.Tensor  # [num_nodes] indices into the flattened [n * max_m] rows
    valid_tokens: torch.Tensor  # [num_nodes] flat step token of each node, request by request
    has_prefix: torch.Tensor  # [num_nodes] bool: the node sees some committed key (it is in a tree_prefixes group)


@dataclass
class KVCacheStep:
    """A step of chains of one length (decodes; verifications of equally many drafts) in
    ``flash_attn_with_kvcache``'s layout: rope, the K/V append and attention in one call."""

    cache_seqlens: torch.Tensor  # [batch] int32: each request's context_len, where its new tokens go
    block_table: torch.Tensor  # [batch, max_blocks] int32
    query_len: int  # new tokens of every request


# (q [num_q, H, D], k_cache, v_cache, group, scale) -> (out [num_q, H, D], lse [num_q, H] float32)
Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class VarlenMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] slot each new token's K/V is written to
    kernel: Kernel  # flash-attn's, or its torch stand-in (engine.attention.varlen_backend)
    groups: list[VarlenGroup]  # chains, decodes and prefill chunks (causal)
    tree_prefixes: list[VarlenGroup]  # tree nodes against their committed context (not causal); one per depth with a window
    tree: TreePart | None
    specs: list[SeqSpec] = field(default_factory=list)  # what it was built from (other tensor-parallel ranks rebuild it)
    block_size: int = 0
    split_by_query_len: bool = False
    window: int | None = None
    windowed: dict = field(default_factory=dict)  # window -> this step's metadata for it (``for_window``)
    kvcache: KVCacheStep | None = None  # set where the backend takes such a step in one call (flash_attn)

    def for_window(self, window: int | None) -> "VarlenMetadata":
        """This step's metadata for layers that see the last ``window`` positions (built once)."""
        if window is None or window == self.window or not any(window_binds(s, window) for s in self.specs):
            return self
        if window not in self.windowed:
            self.windowed[window] = build_varlen_metadata(self.specs, self.block_size, self.slot_mapping.device,
                                                          self.kernel, self.split_by_query_len, window)
        return self.windowed[window]


def _group(specs: list[SeqSpec], starts: list[int], kv_lens: list[int], causal: bool, block_size: int, device,
           window_left: int = -1, qlens: list[int] | None = None, index: np.ndarray | None = None):
    """One kernel call's group: request r's ``qlens[r]`` query rows (default its new tokens,
    flat tokens ``index``) over its first ``kv_lens[r]`` positions."""
    qlen = np.array(qlens if qlens is not None else [s.query_len for s in specs], dtype=np.int64)
    kv = np.array(kv_lens, dtype=np.int64)
    width = max(1, int(-(-kv.max() // block_size)))
    tables = np.zeros((len(specs), width), dtype=np.int32)
    for r, s in enumerate(specs):
        n = min(width, len(s.block_table))
        tables[r, :n] = s.block_table[:n]
    if index is None:
        index = np.concatenate([np.arange(b, b + s.query_len) for b, s in zip(starts, specs)])
    to = lambda a: to_device(a, device)  # noqa: E731
    cu = lambda a: to(np.concatenate([[0], np.cumsum(a)]).astype(np.int32))  # noqa: E731
    return VarlenGroup(to(index), cu(qlen), cu(kv), int(qlen.max()), int(kv.max()), to(tables), causal, window_left)


def _tree_prefixes(specs: list[SeqSpec], starts: list[int], block_size: int, device, window: int | None):
    """The tree nodes' groups over their committed context, and [num_nodes] bool: whether each
    node (request by request) sees a committed key. Without a window one group of every node;
    with one, a group per depth d of one-row queries with ``window_left = window - 2 - d``."""
    if window is None:
        has = np.repeat([s.context_len > 0 for s in specs], [s.query_len for s in specs])
        return [_group(specs, starts, [s.context_len for s in specs], False, block_size, device)], has
    node_depths = [depths(s.parents) for s in specs]  # [query_len] each
    has = np.concatenate([(d <= window - 2) & (s.context_len > 0) for s, d in zip(specs, node_depths)])
    groups = []
    for depth in sorted({int(x) for d in node_depths for x in d if x <= window - 2}):
        nodes = [(r, i) for r, d in enumerate(node_depths) for i in np.flatnonzero(d == depth) if specs[r].context_len]
        if nodes:
            sub = [specs[r] for r, _ in nodes]
            index = np.array([starts[r] + i for r, i in nodes], dtype=np.int64)
            groups.append(_group(sub, [], [s.context_len for s in sub], False, block_size, device,
                                 window - 2 - depth, [1] * len(nodes), index))
    return groups, has


def _tree_part(specs: list[SeqSpec], starts: list[int], device, window: int | None, has_prefix: np.ndarray) -> TreePart:
    qlen = np.array([s.query_len for s in specs], dtype=np.int64)
    max_m = int(qlen.max())
    rows = np.minimum(np.arange(max_m)[None, :], qlen[:, None] - 1)  # [n, max_m]
    token_index = np.asarray(starts, dtype=np.int64)[:, None] + rows
    mask = np.zeros((len(specs), max_m, max_m), dtype=bool)
    for r, s in enumerate(specs):
        m = s.query_len
        mask[r, :m, :m] = tree_mask(s.parents)
        if window is not None:
            mask[r, :m, :m] &= window_mask(s, window)[:, s.context_len :]
        mask[r, m:] = mask[r, m - 1]
    valid_rows = np.flatnonzero(np.arange(max_m)[None, :] < qlen[:, None])
    to = lambda a: to_device(a, device)  # noqa: E731
    return TreePart(to(token_index), to(mask), to(valid_rows), to(token_index.reshape(-1)[valid_rows]), to(has_prefix))


def _chain_groups(specs: list[SeqSpec], split_by_query_len: bool) -> list[list[int]]:
    """Indices of the chain requests of each kernel call: one call for all (flash-attn,
    which does not pad), or, for a kernel that pads to the longest query, long queries
    alone and the rest by query-length bucket (as ``build_attention_metadata`` does)."""
    chains = [i for i, s in enumerate(specs) if s.parents is None]
    if not split_by_query_len:
        return [chains] if chains else []
    groups = [[i] for i in chains if specs[i].query_len > MAX_BATCHED_QUERY]
    buckets: dict[int, list[int]] = {}
    for i in chains:
        if specs[i].query_len <= MAX_BATCHED_QUERY:
            buckets.setdefault((specs[i].query_len - 1).bit_length(), []).append(i)
    return groups + [g for _, g in sorted(buckets.items())]


def build_varlen_metadata(
    specs: list[SeqSpec], block_size: int, device, kernel: Kernel, split_by_query_len: bool = False,
    window: int | None = None, kvcache: bool = False,
) -> VarlenMetadata:
    """Metadata for a step whose flat tokens are ``specs`` in order; ``window``: for layers
    that see the last ``window`` positions; ``kvcache``: also ``KVCacheStep`` where the step
    is chains of one length."""
    starts = np.concatenate([[0], np.cumsum([s.query_len for s in specs])]).tolist()
    new_slots = np.concatenate(  # [num_tokens]
        [slot_mapping(s.block_table, s.context_len, s.context_len + s.query_len, block_size) for s in specs]
    )
    groups = []
    for idx in _chain_groups(specs, split_by_query_len):
        sub = [specs[i] for i in idx]
        groups.append(_group(sub, [starts[i] for i in idx], [s.context_len + s.query_len for s in sub], True, block_size,
                             device, -1 if window is None else window - 1))
    if len(groups) == 1 and len(groups[0].token_index) == starts[-1]:
        groups[0].token_index = None  # every token of the step, in order: no gather, no scatter
    trees = [i for i, s in enumerate(specs) if s.parents is not None]
    tree_prefixes, tree = [], None
    if trees:
        sub, sub_starts = [specs[i] for i in trees], [starts[i] for i in trees]
        tree_prefixes, has_prefix = _tree_prefixes(sub, sub_starts, block_size, device, window)
        tree = _tree_part(sub, sub_starts, device, window, has_prefix)
    meta = VarlenMetadata(to_device(new_slots, device), kernel, groups, tree_prefixes, tree, list(specs),
                          block_size, split_by_query_len, window)
    if kvcache and not trees and len(groups) == 1 and len({s.query_len for s in specs}) == 1:
        seqlens = to_device(np.array([s.context_len for s in specs], dtype=np.int32), device)
        meta.kvcache = KVCacheStep(seqlens, groups[0].block_table, specs[0].query_len)
    return meta
