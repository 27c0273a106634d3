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

- ``tree_prefix``: every tree node against the committed context only
  (``kv_len = context_len``, not causal: all of it is visible);
- ``tree``: every node against the tree's own new tokens, with the tree mask
  (a small dense attention over the step's new K/V, ``TreePart``).
"""

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from engine.attention.metadata import MAX_BATCHED_QUERY, SeqSpec, token_slots, tree_mask
from engine.transfer import to_device


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


@dataclass
class TreePart:
    """The trees' nodes against each other: requests padded to ``max_m`` nodes."""

    token_index: torch.Tensor  # [n, max_m] flat step token of each node (padding repeats the last)
    mask: torch.Tensor  # [n, max_m, max_m] bool, the tree mask (padding rows copy the last row)
    valid_rows: torch.Tensor  # [num_nodes] indices into the flattened [n * max_m] rows
    valid_tokens: torch.Tensor  # [num_nodes] flat step token of each node, request by request
    has_prefix: torch.Tensor  # [num_nodes] bool: the node's request has committed context


# (q [num_q, H, D], k_cache, v_cache, group, scale) -> (out [num_q, H, D], lse [num_q, H] float32)
Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class VarlenMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] slot each new token's K/V is written to
    kernel: Kernel  # flash-attn's, or its torch stand-in (engine.attention.varlen_backend)
    groups: list[VarlenGroup]  # chains, decodes and prefill chunks (causal)
    tree_prefix: VarlenGroup | None  # tree nodes against their committed context (not causal)
    tree: TreePart | None
    specs: list[SeqSpec] = field(default_factory=list)  # what it was built from (other tensor-parallel ranks rebuild it)


def _group(specs: list[SeqSpec], starts: list[int], kv_lens: list[int], causal: bool, block_size: int, device):
    qlen = np.array([s.query_len for s in specs], dtype=np.int64)
    kv = np.array(kv_lens, dtype=np.int64)
    width = max(1, int(-(-kv.max() // block_size)))
    tables = np.zeros((len(specs), width), dtype=np.int32)
    for r, s in enumerate(specs):
        n = min(width, len(s.block_table))
        tables[r, :n] = s.block_table[:n]
    index = np.concatenate([np.arange(b, b + s.query_len) for b, s in zip(starts, specs)])
    to = lambda a: to_device(a, device)  # noqa: E731
    cu = lambda a: to(np.concatenate([[0], np.cumsum(a)]).astype(np.int32))  # noqa: E731
    return VarlenGroup(to(index), cu(qlen), cu(kv), int(qlen.max()), int(kv.max()), to(tables), causal)


def _tree_part(specs: list[SeqSpec], starts: list[int], device) -> TreePart:
    qlen = np.array([s.query_len for s in specs], dtype=np.int64)
    max_m = int(qlen.max())
    rows = np.minimum(np.arange(max_m)[None, :], qlen[:, None] - 1)  # [n, max_m]
    token_index = np.asarray(starts, dtype=np.int64)[:, None] + rows
    mask = np.zeros((len(specs), max_m, max_m), dtype=bool)
    for r, s in enumerate(specs):
        m = s.query_len
        mask[r, :m, :m] = tree_mask(s.parents)
        mask[r, m:] = mask[r, m - 1]
    valid_rows = np.flatnonzero(np.arange(max_m)[None, :] < qlen[:, None])
    has_prefix = np.repeat([s.context_len > 0 for s in specs], qlen)
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
    specs: list[SeqSpec], block_size: int, device, kernel: Kernel, split_by_query_len: bool = False
) -> VarlenMetadata:
    """Metadata for a step whose flat tokens are ``specs`` in order."""
    starts = np.concatenate([[0], np.cumsum([s.query_len for s in specs])]).tolist()
    slot_mapping = np.concatenate(
        [token_slots(s.block_table, s.context_len + s.query_len, block_size)[s.context_len :] for s in specs]
    )
    groups = []
    for idx in _chain_groups(specs, split_by_query_len):
        sub = [specs[i] for i in idx]
        groups.append(_group(sub, [starts[i] for i in idx], [s.context_len + s.query_len for s in sub], True, block_size, device))
    if len(groups) == 1 and len(groups[0].token_index) == starts[-1]:
        groups[0].token_index = None  # every token of the step, in order: no gather, no scatter
    trees = [i for i, s in enumerate(specs) if s.parents is not None]
    tree_prefix = tree = None
    if trees:
        sub, sub_starts = [specs[i] for i in trees], [starts[i] for i in trees]
        tree_prefix = _group(sub, sub_starts, [s.context_len for s in sub], False, block_size, device)
        tree = _tree_part(sub, sub_starts, device)
    return VarlenMetadata(to_device(slot_mapping, device), kernel, groups, tree_prefix, tree, list(specs))
