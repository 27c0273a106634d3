"""Paged KV cache: block pool, block tables, slot mapping and the prefix cache (no torch), KV tensors."""

from kvcache.block_pool import BlockPool
from kvcache.manager import KVCacheManager, blocks_needed, slot_mapping

__all__ = ["BlockPool", "KVCacheManager", "blocks_needed", "slot_mapping"]
