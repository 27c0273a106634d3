"""Tensor-parallel group handle passed to every sharded layer.

At world size 1 (the CPU path and single-GPU serving) every collective is the
identity, so the sharded layers behave as plain layers.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed process group when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's ``x`` along the last dimension."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, n: int, what: str) -> int:
        """This rank's share of ``n`` units; ``n`` must divide evenly."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {self.size}")
        return n // self.size


SINGLE = TPGroup()
