"""EAGLE drafting: a one-layer head over the target's own features (``drafters.eagle_head``).

The target pass that verifies a round also captures, at every token it keeps, the
features the head reads (``feature_layers``); the engine hands them over with
``add_features``, so drafting costs no extra target pass. Pair p of the head's
sequence is ``(feature f_p, token t_{p+1})``; after a round that committed
``t_0 .. t_{L-1}`` the target has computed ``f_0 .. f_{L-2}``, so pairs up to
``L - 2`` are known (the last one is new each round: its token is the round's
correction or bonus token).

Chains and token trees grow alike (``drafters.tree_drafting``; a chain is a tree of
width 1), one depth per head pass. Depth 0 feeds the pending pairs, batched over
the requests, and draws the first level from the last one's output; each later
depth feeds ``(the parent's output, the node's token)`` for the tree's nodes, the
head's stand-in for the feature the target has not computed: the whole tree so
far (tree attention over the known pairs and each node's ancestors, node at head
position ``num_cached + its depth``), or while it is a chain its newest node only.
Cache after drafting a chain: the known pairs, then ``k - 1`` guessed ones.
``commit`` rolls every guessed pair back (``KVCacheManager.truncate``): the
target's real features replace them next round, so an accepted branch needs no
KV move.

A request whose features start after a gap (its prefix came from the prefix cache,
or the drafter dropped it after a failure) starts the head's sequence afresh there:
the head then sees less context, which costs acceptance, never exactness. Head
positions count from the first pair it holds.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.spec_decode.drafter import DraftSlot
from drafters.draft_model import SamplingDrafter
from drafters.eagle_head import EagleHead, load_eagle_head
from drafters.tree_drafting import GrowingTree, template_of
from engine.utils import tree
from engine.attention import SeqSpec
from engine.attention.backends import TORCH, AttentionBackend
from engine.worker.gpu_memory import DrafterMemory
from engine.utils.transfer import to_device
from kvcache import KVCacheManager
from kvcache.tensors import KVSpec, PagedKV


@dataclass
class _HeadState:
    """One request's place in the head's sequence."""

    base: int  # target position of the head's pair 0
    num_cached: int = 0  # pairs with real features in the head's cache: positions base .. base + num_cached - 1
    pending: list[torch.Tensor] = field(default_factory=list)  # features [n, F] of the next positions, in order
    num_pending: int = 0  # their rows (kept: a paused request's pending list grows every step)

    @property
    def next_position(self) -> int:
        return self.base + self.num_cached + self.num_pending


class EagleDrafter(SamplingDrafter):
    def __init__(self, head: EagleHead, num_blocks: int, block_size: int, kv_dtype, device, cost_per_token: float,
                 attention: AttentionBackend = TORCH):
        super().__init__(device)
        self.head, self.block_size = head, block_size
        self.build_metadata = attention.build_metadata  # the target's backend (``cpu``: one C call a head pass)
        self.feature_layers = head.feature_layers
        cfg = head.config
        self.kv = KVCacheManager(num_blocks, block_size)
        self.paged = PagedKV(KVSpec(1, cfg.num_key_value_heads, head.head_dim, block_size, kv_dtype), num_blocks,
                             device)
        self.cost_per_token = cost_per_token
        self.states: dict[str, _HeadState] = {}
        self.outputs: dict[str, list[torch.Tensor]] = {}  # a growing tree's head outputs [H]: the root's, then per node

    def add_features(self, features: dict[str, tuple[int, torch.Tensor]]) -> None:
        for rid, (start, feats) in features.items():
            st = self.states.get(rid)
            if st is None or start > st.next_position:  # a gap: start the head's sequence here
                self.free(rid)
                st = self.states[rid] = _HeadState(base=start)
            skip = st.next_position - start  # recomputed after a preemption: known already
            if skip < len(feats):
                st.pending.append(feats[skip:])
                st.num_pending += len(feats) - skip

    def context_class(self, request) -> int | None:
        st = self.states.get(request.request_id)
        return 0 if st is not None and st.pending else None  # nothing to draft from before the first features

    def _can_draft(self, slot: DraftSlot) -> bool:
        return slot.num_draft_tokens > 0 and self._has_pending(slot.request.request_id)

    def _reserve_tree(self, slot: DraftSlot) -> bool:
        """KV for the pending pairs and every node the slot's tree may have."""
        st = self.states[slot.request.request_id]
        return self.kv.allocate_slots(slot.request.request_id, st.num_cached + st.num_pending + len(template_of(slot)))

    def _tree_forward(self, trees: list[GrowingTree], depth: int) -> torch.Tensor:
        """Draft logits [rows, vocab] after each node of ``depth - 1`` (the root at 0) of every tree: one
        head pass over the pending pairs (depth 0), then over the tree so far (while it is a
        chain, over its nodes not in the cache: ``GrowingTree.unfed``)."""
        live = [g.slot for g in trees]
        if depth == 0:
            self.outputs.clear()  # the last round's
            feeds = self._feeds(live)
            last = self._forward(live, feeds)  # [n, H]
            self._ingested(live, feeds)
            for g, row in zip(trees, last):
                self.outputs[g.slot.request.request_id] = [row]
            return self.head.draft_logits(last)
        feeds, specs, firsts = [], [], []
        for g in trees:
            rid = g.slot.request.request_id
            first, nodes = g.unfed() or (0, tuple(g.parents))
            outs = self.outputs[rid]  # outs[0]: the root's; outs[1 + i]: node i's
            hidden = torch.stack([outs[p + 1] for p in g.parents[first:]])  # [fed, H]: each node's parent's output
            pos = self.states[rid].num_cached + first
            feeds.append((list(g.token_ids[first:]), hidden, pos))
            specs.append(SeqSpec(pos, len(nodes), self.kv.block_table(rid), None if tree.is_chain(nodes) else nodes))
            firsts.append(first)
            g.num_fed = len(g.parents)
        out = self._forward_all(live, feeds, specs)  # [sum fed, H]
        rows, start = [], 0
        for g, (ids, _, _), first in zip(trees, feeds, firsts):
            self.outputs[g.slot.request.request_id][1 + first :] = list(out[start : start + len(ids)])
            rows.extend(start + n - first for n in g.level(depth))
            start += len(ids)
        return self.head.draft_logits(out[rows])  # one head pass for every tree

    def _has_pending(self, rid: str) -> bool:
        st = self.states.get(rid)
        return st is not None and bool(st.pending)

    def _feeds(self, live: list[DraftSlot]) -> list[tuple[list[int], torch.Tensor, int]]:
        """Per live request its pending pairs: (token ids, fused features [n, H], head position
        of the first)."""
        feeds = []
        for s in live:
            st, ids = self.states[s.request.request_id], s.request.token_ids
            first = st.base + st.num_cached  # target position of the first pending feature
            tokens = list(ids[first + 1 : first + 1 + st.num_pending])
            feats = torch.cat(st.pending)[: len(tokens)]  # [n, F]
            feeds.append((tokens, self.head.fuse(feats), st.num_cached))
        return feeds

    def _ingested(self, live, feeds) -> None:
        """The pending pairs are in the head's cache now, for good."""
        for s, (ids, _, _) in zip(live, feeds):
            st = self.states[s.request.request_id]
            st.num_cached += len(ids)
            st.pending.clear()
            st.num_pending = 0

    def _forward(self, live: list[DraftSlot], feeds) -> torch.Tensor:
        """One batched head pass; the output [n, H] at each request's last fed pair."""
        specs = [SeqSpec(pos, len(ids), self.kv.block_table(s.request.request_id)) for s, (ids, _, pos) in zip(live, feeds)]
        out = self._forward_all(live, feeds, specs)  # [T, H]
        return out[to_device(np.cumsum([len(f[0]) for f in feeds]) - 1, self.device)]

    def _forward_all(self, live: list[DraftSlot], feeds, specs: list[SeqSpec]) -> torch.Tensor:
        """One batched head pass over ``feeds`` laid out as ``specs``; the output [T, H] of
        every fed pair (a tree's nodes at head position ``pos + depth``)."""
        meta = self.build_metadata(specs, self.block_size, self.device)
        t = lambda a: to_device(a, self.device, torch.long)  # noqa: E731
        ids = t([tok for f in feeds for tok in f[0]])
        positions = []
        for (_, _, pos), spec in zip(feeds, specs):
            offsets = tree.depths(spec.parents) if spec.parents else np.arange(spec.query_len)
            positions.extend((pos + offsets).tolist())
        return self.head(ids, torch.cat([f[1] for f in feeds]), t(positions), meta, self.paged)  # [T, H]

    def commit(self, request) -> None:
        st = self.states.get(request.request_id)
        if st is not None:  # drop the guessed pairs: real features replace them
            self.kv.truncate(request.request_id, st.num_cached)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.states.pop(request_id, None)
        self.kv.free(request_id)


def memory_needs(spec, *, dtype, block_size, kv_dtype=None, **_) -> DrafterMemory:
    """The head's weights and KV bytes per block, for the GPU memory budget."""
    from drafters.eagle_head import head_memory
    from engine.worker.model_store import resolve_model

    return DrafterMemory(*head_memory(resolve_model(spec.model), dtype, block_size, kv_dtype))


def eagle_factory(kind: str):
    def factory(spec, *, target, num_blocks, block_size, dtype, device, attention=TORCH, kv_dtype=None,
                **_) -> EagleDrafter:
        from engine.worker.model_store import resolve_model

        if not spec.model:
            raise ValueError(f'speculative method "{kind}" needs "model": a local directory with an {kind} head')
        path = resolve_model(spec.model)
        head = load_eagle_head(path, kind, target, dtype, device, target.rotary.cos.shape[0])
        cost = head.num_parameters() / sum(p.numel() for p in target.parameters())
        return EagleDrafter(head, num_blocks, block_size, kv_dtype or dtype, device, cost, attention)

    factory.__doc__ = f"An {kind} head reading the target's features (drafters.eagle_head)."
    return factory


build_eagle = eagle_factory("eagle")  # the registry's names (engine.spec_decode.registry)
build_eagle3 = eagle_factory("eagle3")
