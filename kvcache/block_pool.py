"""The block pool: which KV-cache blocks are free, and who holds the rest.

Pure bookkeeping over integer block ids; no tensors. A block is free when its
reference count is zero. Reference counts exist so that a later prefix cache can
share a block between requests; today every block has one holder.
"""

from collections import deque


class BlockPool:
    """A fixed set of ``num_blocks`` block ids with a free list and ref counts.

    ``allocate`` hands out the least recently freed blocks first (FIFO), which
    keeps recently freed blocks (and any cached content in them) alive longest.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks; raises if fewer are free (callers check first)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref_counts[b] == 0:
                raise RuntimeError(f"incref of free block {b}")
            self._ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero become free."""
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)
