"""Per-request block tables over a shared block pool.

A request's KV entries for token positions ``0 .. num_tokens-1`` live in the
slots ``block_table[pos // block_size] * block_size + pos % block_size``::

    block_size = 4, block_table = [7, 2]
    position:  0  1  2  3 | 4  5  6  7
    slot:     28 29 30 31 | 8  9 10 11

``allocate_slots`` grows a table to cover a number of tokens before a forward
pass writes them; ``truncate`` is the rollback (it frees the blocks that no
longer hold any kept position); ``free`` releases everything. No torch here.
"""

import numpy as np

from kvcache.block_pool import BlockPool

PAD_SLOT = -1  # slot of a token whose KV must not be written


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Owns the block tables of all live requests, keyed by request id."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks that ``allocate_slots(request_id, num_tokens)`` would take."""
        have = len(self._tables.get(request_id, ()))
        return max(0, blocks_needed(num_tokens, self.block_size) - have)

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make the table cover positions ``0 .. num_tokens-1``.

        Returns False, allocating nothing, when the pool has too few free blocks.
        """
        need = self.num_new_blocks(request_id, num_tokens)
        if need > self.pool.num_free_blocks:
            return False
        table = self._tables.setdefault(request_id, [])
        if need:
            table.extend(self.pool.allocate(need))
        return True

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep positions ``0 .. num_tokens-1``; free blocks past them."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = blocks_needed(num_tokens, self.block_size)
        if keep < len(table):
            self.pool.free(table[keep:])
            del table[keep:]

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(table)


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """Slots of positions ``start .. end-1`` of one request. [end - start] int64."""
    pos = np.arange(start, end, dtype=np.int64)
    table = np.asarray(block_table, dtype=np.int64)
    return table[pos // block_size] * block_size + pos % block_size
