"""Self-drafting: the target's first layers, its final norm and head, on the target's own KV cache.

Layers ``0 .. L-1`` compute the same keys and values whichever pass runs them,
so the drafter needs no cache of its own: it attends over the target's cache of
the committed context and writes its entries into the slots the scheduler
reserved for this round, those of the last committed token and of the drafts
``d_1 .. d_{k-1}`` (``d_k`` is sampled, never fed)::

    slots:   ... committed ... | t  d_1  d_2 ... d_k |
    drafter writes (layers < L): t  d_1 ... d_{k-1}
    verification writes (all layers): t  d_1 ... d_k, before any attention reads them

Verification overwrites every entry the drafter wrote, so nothing of drafting
survives a round: there is nothing to roll back, and nothing to catch up on
after the speculation policy paused drafting.

Chains and token trees grow alike (``drafters.tree_drafting``; a chain is a tree of
width 1), one depth per forward over the last committed token and the tree so far
(a chain: its newest node), node ``i`` in the slot of offset ``1 + i`` at position
``len - 1 + 1 + depth``, as verification will write it.
"""

import torch

from drafters.draft_model import SamplingDrafter
from engine.utils import tree
from engine.attention import SeqSpec
from engine.attention.backends import TORCH, AttentionBackend
from engine.utils.transfer import to_device


class EarlyExitDrafter(SamplingDrafter):
    def __init__(self, target, kv, num_layers: int, block_size: int, device, attention: AttentionBackend = TORCH):
        super().__init__(device)
        self.model, self.target_kv, self.num_layers, self.block_size = target, kv, num_layers, block_size
        self.build_metadata = attention.build_metadata  # the target's backend (``cpu``: one C call a layer)
        self.cost_per_token = _cost_per_token(target, num_layers)

    def _tree_forward(self, trees, depth: int) -> torch.Tensor:
        """Logits [rows, vocab] after each node of ``depth - 1`` (the root at 0) of every tree: one
        forward over each request's last committed token and its tree so far, or, past
        depth 0 while the tree is a chain, its nodes not in the cache (``GrowingTree.unfed``)."""
        specs, ids, positions, rows, start = [], [], [], [], 0
        for g in trees:
            tokens, unfed = g.slot.request.token_ids, g.unfed() if depth else None
            if unfed is None:  # [t_last, nodes...]
                fed, first, base = tree.with_prefix(1, g.parents), 0, len(tokens) - 1
                mask = fed if g.parents else None
            else:  # the newest nodes, after t_last and the ``first`` nodes in the cache
                first, fed = unfed
                base, mask = len(tokens) + first, None
            specs.append(SeqSpec(base, len(fed), list(g.slot.block_table), mask))
            ids.extend(([] if unfed else [tokens[-1]]) + g.token_ids[first:])
            positions.extend((base + tree.depths(fed)).tolist())
            rows.extend(start + (0 if unfed else 1) + n - first for n in g.level(depth))
            start += len(fed)
            g.num_fed = len(g.parents)
        t = lambda a: to_device(a, self.device, torch.long)  # noqa: E731
        meta = self.build_metadata(specs, self.block_size, self.device)
        hidden = self.model(t(ids), t(positions), meta, self.target_kv, num_layers=self.num_layers)  # [T, hidden]
        return self.model.compute_logits(hidden[t(rows)])  # one head pass for every tree


def _cost_per_token(target, num_layers: int) -> float:
    """One draft's weight reads over a decode step's: ``L`` layers plus the head, of all layers
    plus the head (a decode step streams the weights once)."""
    layer = sum(p.numel() for p in target.layers[0].parameters())
    head = target.lm_head.weight.numel()
    return (num_layers * layer + head) / (len(target.layers) * layer + head)


def build(spec, *, target, target_kv, block_size, device, attention=TORCH, **_) -> EarlyExitDrafter:
    """Self-drafting: the target's first ``num_layers`` layers, its final norm and head."""
    total = target.config.num_hidden_layers
    layers = spec.num_layers or max(1, total // 4)
    if not 1 <= layers < total:
        raise ValueError(f"early_exit num_layers must be in [1, {total - 1}], got {layers}")
    return EarlyExitDrafter(target, target_kv, layers, block_size, device, attention)
