"""Column- and row-parallel linear layers with their own weight loaders.

Column parallel: the output features are split across ranks, weight shard
``[out / tp, in]``; no communication. Row parallel: the input features are split,
weight shard ``[out, in / tp]``; the partial outputs are summed by an all-reduce
in ``forward``. At tp size 1 both are a plain matmul.

Merged layers (QKV, gate+up) hold several logical matrices stacked along the
output dimension; ``load(shard_id, full_weight)`` copies this rank's slice of
one of them into place.

On the CPU in float32, ``prepack()`` (called once after loading) reorders each
weight into oneDNN's blocked layout; its skinny GEMM then streams the weights
at close to memory bandwidth. The reorder's batch-size hint picks the kernel:
measured here on SmolLM2's 30 layers (`python -m bench.kernels`), a hint of
16 runs 1 row in 18-20 ms, 4 rows in 14-17 ms and 11 rows in 19-21 ms, where
a hint of 1 takes 21, 26-28 and 33-34 ms and ``F.linear`` 35, 48 and 87 ms.
So verification passes cost little more than a decode step; inputs of 1-3
rows are padded to 4, the cheapest size.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel import SINGLE, TPGroup


PACK_BATCH_HINT = 16
MIN_PACKED_ROWS = 4


def can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """A ``weight`` [out, in] applied as ``x @ weight.T``, through a prepacked copy when there is one."""

    weight: nn.Parameter
    packed: torch.Tensor | None = None

    def prepack(self) -> None:
        """Reorder the weight once for oneDNN (CPU, float32); call after the weights are loaded."""
        if can_prepack(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, PACK_BATCH_HINT)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if self.packed is not None:
            rows = x.shape[0]
            if rows < MIN_PACKED_ROWS:  # oneDNN's kernel for 1-2 rows is slower than for 4
                x = torch.cat([x, x.new_zeros(MIN_PACKED_ROWS - rows, x.shape[1])])
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
            return y[:rows] if rows < MIN_PACKED_ROWS else y
        return F.linear(x, self.weight)


class ColumnParallelLinear(PackedLinear):
    def __init__(self, in_features: int, out_sizes: list[int], tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.out_sizes = [tp.shard(n, "output features") for n in out_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.out_sizes), in_features), requires_grad=False)

    def load(self, shard_id: int, full: torch.Tensor) -> None:
        """Copy this rank's rows of logical matrix ``shard_id`` (full: [out_i, in])."""
        size = self.out_sizes[shard_id]
        offset = sum(self.out_sizes[:shard_id])
        rows = full.narrow(0, self.tp.rank * size, size)
        self.weight.data[offset : offset + size].copy_(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul; shard ids "q", "k", "v"."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: TPGroup = SINGLE):
        super().__init__(hidden, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], tp)

    def load(self, shard_id, full: torch.Tensor) -> None:
        super().load("qkv".index(shard_id), full)


class RowParallelLinear(PackedLinear):
    def __init__(self, in_features: int, out_features: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.in_shard = tp.shard(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_shard), requires_grad=False)

    def load(self, shard_id, full: torch.Tensor) -> None:
        self.weight.data.copy_(full.narrow(1, self.tp.rank * self.in_shard, self.in_shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.matmul(x))


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split across ranks."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.shard_size = tp.shard(vocab_size, "vocab_size")
        self.start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden), requires_grad=False)

    def load(self, shard_id, full: torch.Tensor) -> None:
        self.weight.data.copy_(full.narrow(0, self.start, self.shard_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, PackedLinear):
    """Output projection over a vocab-sharded weight; gathers the full logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last_dim(self.matmul(hidden))
