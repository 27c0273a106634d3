"""Tensor-parallel group handle passed to every sharded layer.

At world size 1 (the CPU path and single-GPU serving) every collective is the
identity, so the sharded layers behave as plain layers. At size > 1 ``group``
is a ``torch.distributed`` process group object (gloo or NCCL) built by
``engine.distributed.group``; the collectives call it directly, so no
process-wide default group exists and several engines may live in one process.
"""

import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CommStats:
    """Collectives this rank has waited for, and the wall time they took (the
    transfer plus any wait for a slower rank); read by ``bench/tp.py``."""

    calls: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1
    comm: CommStats = field(default_factory=CommStats, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the ranks, in place."""
        if self.size > 1:
            t = time.perf_counter()
            self.group.allreduce([x]).wait()
            self._count(t)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's ``x`` (same shape on every rank) along the last dimension."""
        if self.size == 1:
            return x
        t = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        self._count(t)
        return torch.cat(parts, dim=-1)

    def _count(self, since: float) -> None:
        self.comm.calls += 1
        self.comm.seconds += time.perf_counter() - since

    def shard(self, n: int, what: str) -> int:
        """This rank's share of ``n`` units; ``n`` must divide evenly."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {self.size}")
        return n // self.size

    def split(self, n: int, what: str) -> tuple[int, int]:
        """``(start, size)`` of this rank's part of ``n`` units split as evenly as
        possible, the first ``n % size`` ranks taking one more. Example: 3 KV heads
        over 2 ranks -> rank 0 ``(0, 2)``, rank 1 ``(2, 1)``."""
        if n < self.size:
            raise ValueError(f"{what}={n} is smaller than tensor-parallel size {self.size}: a rank would get none")
        base, extra = divmod(n, self.size)
        return self.rank * base + min(self.rank, extra), base + (self.rank < extra)


SINGLE = TPGroup()
