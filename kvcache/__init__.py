"""Paged KV cache: block pool, block tables, slot mapping and the prefix cache (no torch), KV tensors."""

from kvcache.block_pool import BlockPool
from kvcache.manager import PAD_SLOT, KVCacheManager, blocks_needed, slot_mapping

__all__ = ["BlockPool", "KVCacheManager", "PAD_SLOT", "blocks_needed", "slot_mapping"]
