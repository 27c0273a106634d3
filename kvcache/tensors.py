"""The paged KV tensors: one preallocated key and one value tensor per layer.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``. Seen
flat as ``[num_blocks * block_size, num_kv_heads, head_dim]``, row ``slot``
holds one token's key (or value), with slots from ``kvcache.manager``.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_kv_heads: int  # per tensor-parallel rank
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for(self, budget_bytes: int) -> int:
        return max(1, budget_bytes // self.bytes_per_block())


class PagedKV:
    """Holds the KV tensors of every layer. ``layer(i)`` is ``(k_cache, v_cache)``."""

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device, pad_block: bool = False):
        """``pad_block``: one more block, ``num_blocks``, past the manager's: padding rows of a
        bucketed step write and read there (``engine.worker.step_buffers``)."""
        shape = (num_blocks + pad_block, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.spec = spec
        self.num_blocks = num_blocks
        self.pad_block = num_blocks if pad_block else None
        self.k = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]


def move_slots(kv: PagedKV, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the K/V rows at slots ``src`` [m] to slots ``dst`` [m] in every layer
    (all rows are read before any is written). After a token tree is verified this
    puts the accepted path where a plain decode would have written it."""
    for i in range(kv.spec.num_layers):
        for cache in kv.layer(i):
            flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, heads, head_dim]
            flat[dst] = flat[src]
