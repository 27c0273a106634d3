"""Attention metadata of one step, built once on the CPU and shared by all layers.

The step's tokens are one flat sequence, request after request::

    request:   r0 (prefill chunk, 5 new)   r1 (decode, 1)   r2 (chain of 3)
    token:     0  1  2  3  4               5                6  7  8

Each request ``r`` has ``context_len[r]`` tokens already in the KV cache and
``query_len[r]`` new ones. For the C kernel (``listed=True``, the ``cpu`` backend)
every token is listed with the KV slots it sees (``ListedQueries``). Otherwise requests
whose query is long (prefill chunks) are attended one by one; the rest (decodes, draft
chains and trees) in padded, masked batches, one per query-length bucket (1, 2, 3-4,
5-8, ... tokens), so that a few requests verifying drafts do not pad every plain decode
to their length.

A request may carry a tree: ``parents[i]`` is the index (among its new tokens)
of new token ``i``'s parent, -1 for a child of the last committed token. Token
``i`` then sees the committed prefix plus its own ancestors and itself. A chain
is the tree ``parents = [-1, 0, 1, ...]``, which is the default.

Sliding-window layers (Mistral, Gemma) see only the last ``window`` positions:
a query at position ``p`` sees the keys at positions ``p - window + 1 .. p``
(Hugging Face's rule, ``q - k < window``). A tree node's position is the
context length plus its depth, so a node sees the ancestors and committed keys
within ``window`` of its own depth. ``AttentionMetadata.for_window`` builds a
step's windowed metadata once, from the same specs, for every layer of that window.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.utils import tree
from engine.utils.ranges import ranges
from engine.utils.transfer import to_device
from kvcache.manager import slot_mapping, slot_mappings

# Requests with more new tokens than this are attended on their own.
MAX_BATCHED_QUERY = 64


@dataclass(frozen=True)
class SeqSpec:
    """One request's part of a step, as the runner sees it."""

    context_len: int  # tokens already in the KV cache
    query_len: int  # new tokens computed this step
    block_table: list[int]
    parents: tuple[int, ...] | None = None  # tree over the new tokens; None = chain


@dataclass
class SoloQuery:
    """A request attended on its own: a long query (prefill chunk), or the only one of its bucket."""

    start: int  # first flat token index
    end: int
    kv_slots: torch.Tensor | None  # [context_len + query_len] slots to gather; None: kv_span or no context
    kv_span: tuple[int, int] | None  # (first slot, length) when the slots are contiguous: a view, no gather
    mask: torch.Tensor | None  # [query_len, kv_len] bool, True = attend; None: see ``causal``
    causal: bool  # with no mask: causal over the new tokens alone (True), or every key visible (False)


@dataclass
class BatchedQuery:
    """Short queries of many requests, padded to ``max_q`` rows each."""

    token_index: torch.Tensor  # [n, max_q] flat token index of each row (padding repeats the last)
    valid: torch.Tensor  # [n, max_q] bool, False on padding rows
    kv_slots: torch.Tensor  # [n, max_kv] slots of positions 0 .. max_kv-1 (garbage past each length)
    mask: torch.Tensor  # [n, 1, max_q, max_kv] bool, True = attend
    valid_rows: torch.Tensor  # [num_valid] indices into the flattened [n * max_q] rows
    valid_tokens: torch.Tensor  # [num_valid] flat token index of each valid row
    rows_are_tokens: bool  # the rows are exactly the step's tokens, in order (no scatter needed)


@dataclass
class ListedQueries:
    """Tokens that each attend over a prefix of a list of KV slots (``cpu_kernels.paged_attention``):
    no padding, no gather. The tokens of a chain share their request's list, each seeing one
    key more than the one before. A tree has one list per leaf, the committed prefix and the
    path from a root down to that leaf (``engine.utils.tree.leaf_paths``); each node is listed once, under the
    first leaf whose path holds it, and sees the committed prefix, its ancestors and itself.
    Consecutive tokens of one list are attended together by the kernel (it reads each key
    once for them)."""

    rows: torch.Tensor  # [n] flat token index
    start: torch.Tensor  # [n] where the token's list begins in ``slots``
    length: torch.Tensor  # [n] how many keys it sees
    slots: torch.Tensor  # [total] the lists, one after another


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] slot each new token's K/V is written to
    solo: list[SoloQuery] = field(default_factory=list)
    batched: list[BatchedQuery] = field(default_factory=list)  # one per query-length bucket
    listed: ListedQueries | None = None  # built with ``listed=True``: every query, for the CPU kernel
    specs: list[SeqSpec] = field(default_factory=list)  # what it was built from (other tensor-parallel ranks rebuild it)
    block_size: int = 0
    window: int | None = None  # a query sees the last ``window`` positions; None: all
    windowed: dict = field(default_factory=dict)  # window -> this step's metadata for it (``for_window``)

    def for_window(self, window: int | None) -> "AttentionMetadata":
        """This step's metadata for layers that see the last ``window`` positions: itself where
        no query of the step reaches that far back, else built once and kept."""
        if window is None or window == self.window or not any(window_binds(s, window) for s in self.specs):
            return self
        if window not in self.windowed:
            self.windowed[window] = build_attention_metadata(
                self.specs, self.block_size, self.slot_mapping.device, self.listed is not None, window)
        return self.windowed[window]

    def lists_all(self, num_tokens: int) -> bool:
        """Whether all ``num_tokens`` tokens attend through ``listed`` (a whole-layer C call can run)."""
        return self.listed is not None and not self.solo and not self.batched and self.listed.rows.shape[0] == num_tokens

    def listed_args(self) -> tuple:
        """(slot_mapping, rows, start, length, slots): a listed step's tensors, as
        ``cpu_kernels.step_args`` takes them after cos and sin."""
        listed = self.listed
        return self.slot_mapping, listed.rows, listed.start, listed.length, listed.slots


def tree_mask(parents: tuple[int, ...]) -> np.ndarray:
    """[m, m] bool: row i sees itself and its ancestors among the new tokens.

    >>> tree_mask((-1, 0, 0)).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    """
    m = len(parents)
    mask = np.eye(m, dtype=bool)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"parent {p} of node {i} must come before it")
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def window_binds(spec: SeqSpec, window: int) -> bool:
    """Whether some query of ``spec`` sits ``window`` or more positions after position 0."""
    depth = int(tree.depths(spec.parents).max()) if spec.parents else spec.query_len - 1
    return spec.context_len + depth >= window


def window_mask(spec: SeqSpec, window: int) -> np.ndarray:
    """[query_len, context_len + query_len] bool: the key (committed positions, then the new
    tokens in order) lies within ``window`` positions of the query (position = context + depth).

    >>> window_mask(SeqSpec(2, 2, [0]), 2).astype(int).tolist()
    [[0, 1, 1, 1], [0, 0, 1, 1]]
    """
    depth = tree.depths(spec.parents) if spec.parents else np.arange(spec.query_len)
    q_pos = spec.context_len + depth
    k_pos = np.concatenate([np.arange(spec.context_len), q_pos])
    return q_pos[:, None] - k_pos[None, :] < window


def _solo(spec: SeqSpec, start: int, block_size: int, device, window: int | None = None) -> SoloQuery:
    end = start + spec.query_len
    windowed = window is not None and window_binds(spec, window)
    chain = spec.parents is None
    if spec.context_len == 0 and chain and not windowed:
        return SoloQuery(start, end, None, None, None, causal=True)
    kv_len = spec.context_len + spec.query_len
    blocks = spec.block_table[: -(-kv_len // block_size)]
    slots = span = None
    if spec.context_len == 0 and chain:
        pass  # the step's own keys and values
    elif blocks == list(range(blocks[0], blocks[0] + len(blocks))):
        span = (blocks[0] * block_size, kv_len)
    else:
        slots = to_device(slot_mapping(spec.block_table, 0, kv_len, block_size), device)
    if spec.query_len == 1 and chain and not windowed:
        return SoloQuery(start, end, slots, span, None, causal=False)  # one token sees everything
    mask = np.ones((spec.query_len, kv_len), dtype=bool)
    mask[:, spec.context_len :] = np.tri(spec.query_len, dtype=bool) if chain else tree_mask(spec.parents)
    if windowed:
        mask &= window_mask(spec, window)
    return SoloQuery(start, end, slots, span, to_device(mask, device), causal=False)


def _batched(specs: list[SeqSpec], starts: list[int], total_tokens: int, block_size: int, device,
             window: int | None = None) -> BatchedQuery:
    ctx = np.array([s.context_len for s in specs], dtype=np.int64)  # [n]
    qlen = np.array([s.query_len for s in specs], dtype=np.int64)  # [n]
    max_q, max_kv = int(qlen.max()), int((ctx + qlen).max())
    rows = np.minimum(np.arange(max_q)[None, :], qlen[:, None] - 1)  # [n, max_q]
    token_index = np.asarray(starts, dtype=np.int64)[:, None] + rows
    valid = np.arange(max_q)[None, :] < qlen[:, None]
    width = max(len(s.block_table) for s in specs)
    tables = np.zeros((len(specs), width), dtype=np.int64)
    for r, s in enumerate(specs):
        tables[r, : len(s.block_table)] = s.block_table
    pos = np.arange(max_kv, dtype=np.int64)
    kv_slots = np.take_along_axis(tables, np.minimum(pos // block_size, width - 1)[None, :].repeat(len(specs), 0), 1)
    kv_slots = kv_slots * block_size + pos % block_size
    # Chain rule: row i sees positions up to context_len + i (padding rows repeat the last).
    mask = pos[None, None, :] <= (ctx[:, None] + rows)[:, :, None]  # [n, max_q, max_kv]
    for r, s in enumerate(specs):
        c, m = s.context_len, s.query_len
        if s.parents is not None:
            mask[r, :m, c : c + m] = tree_mask(s.parents)
        if window is not None and window_binds(s, window):
            mask[r, :m, : c + m] &= window_mask(s, window)
        mask[r, m:] = mask[r, m - 1]
    valid_rows = np.flatnonzero(valid)
    valid_tokens = token_index.reshape(-1)[valid_rows]
    rows_are_tokens = bool(valid.all()) and np.array_equal(valid_tokens, np.arange(total_tokens))
    to = lambda a: to_device(a, device)  # noqa: E731
    return BatchedQuery(
        to(token_index), to(valid), to(kv_slots), to(mask[:, None]), to(valid_rows), to(valid_tokens), rows_are_tokens
    )


def _listed(specs: list[SeqSpec], starts: list[int], slots: np.ndarray, kv_starts: list[int],
            window: int | None) -> ListedQueries:
    """``slots``: every request's slots of positions 0 .. context_len + query_len - 1, request
    after request, request ``r``'s from ``kv_starts[r]``."""
    if all(spec.parents is None for spec in specs):
        start, length = _listed_chains(specs, kv_starts)
        rows, lists = [np.arange(len(start))], [slots]
    else:
        rows, start, length, lists = _listed_trees(specs, starts, slots, kv_starts)
    to = lambda parts: torch.from_numpy(np.concatenate(parts).astype(np.int64))  # noqa: E731
    if window is not None:  # a token's list is in position order: it sees the last ``window`` of its prefix
        start, length = start + np.maximum(length - window, 0), np.minimum(length, window)
    return ListedQueries(to(rows), to([start]), to([length]), to(lists))


def _listed_chains(specs: list[SeqSpec], kv_starts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of every token of a step of chains only: token i of a request sees
    its positions 0 .. c + i, and each request's list is its own slots (all at once)."""
    ctx = np.array([s.context_len for s in specs], dtype=np.int64)
    qlen = np.array([s.query_len for s in specs], dtype=np.int64)
    return np.repeat(np.asarray(kv_starts, dtype=np.int64), qlen), ranges(ctx + 1, qlen)


def _listed_trees(specs: list[SeqSpec], starts: list[int], all_slots: np.ndarray, kv_starts: list[int]) -> tuple:
    """(rows, start, length, lists) of a step with trees, request by request."""
    rows, start, length, lists, offset = [], [], [], [], 0
    for spec, first, kv_start in zip(specs, starts, kv_starts):
        c, m = spec.context_len, spec.query_len
        slots = all_slots[kv_start : kv_start + c + m]
        if spec.parents is None:  # token i sees positions 0 .. c + i
            rows.append(np.arange(first, first + m))
            start.append(np.full(m, offset))
            length.append(np.arange(c + 1, c + m + 1))
            lists.append(slots)
            offset += len(slots)
            continue
        for path, own in tree.leaf_paths(spec.parents):  # a node at depth d sees the first c + d + 1 of its path's list
            rows.append(first + np.array(own))
            start.append(np.full(len(own), offset))
            length.append(c + 1 + np.arange(len(path) - len(own), len(path)))
            lists.append(np.concatenate([slots[:c], slots[c:][path]]))
            offset += c + len(path)
    return rows, np.concatenate(start), np.concatenate(length), lists


def build_attention_metadata(specs: list[SeqSpec], block_size: int, device="cpu", listed=False,
                             window: int | None = None) -> AttentionMetadata:
    """Metadata for a step whose flat tokens are ``specs`` in order. ``listed`` (CPU only):
    every request goes to ``meta.listed``, prefill chunks too, so that one kernel attends
    every query of every step the same way (a token's bits never depend on its step).
    ``window``: for layers that see the last ``window`` positions."""
    starts = np.concatenate([[0], np.cumsum([s.query_len for s in specs])]).tolist()
    ctx = np.array([s.context_len for s in specs], dtype=np.int64)  # [n]
    kv_lens = ctx + np.array([s.query_len for s in specs], dtype=np.int64)  # [n]
    all_slots = slot_mappings([s.block_table for s in specs], kv_lens, block_size)  # [sum(kv_lens)]
    kv_starts = np.cumsum(kv_lens) - kv_lens
    new = np.arange(len(all_slots)) - np.repeat(kv_starts, kv_lens) >= np.repeat(ctx, kv_lens)  # position >= context_len
    meta = AttentionMetadata(to_device(all_slots[new], device), specs=list(specs), block_size=block_size, window=window)
    if listed:
        meta.listed = _listed(specs, starts[:-1], all_slots, kv_starts.tolist(), window)
        return meta
    buckets: dict[int, list[int]] = {}
    for i, s in enumerate(specs):
        if s.query_len > MAX_BATCHED_QUERY:
            meta.solo.append(_solo(s, starts[i], block_size, device, window))
        else:
            buckets.setdefault((s.query_len - 1).bit_length(), []).append(i)
    for _, group in sorted(buckets.items()):
        if len(group) == 1:  # alone in its bucket: no padding, and often no gather
            meta.solo.append(_solo(specs[group[0]], starts[group[0]], block_size, device, window))
        else:
            meta.batched.append(
                _batched([specs[i] for i in group], [starts[i] for i in group], starts[-1], block_size, device, window)
            )
    return meta
