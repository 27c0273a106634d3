"""Column- and row-parallel linear layers with their own weight loaders.

Column parallel: the output features are split across ranks, weight shard
``[out / tp, in]``; no communication. Row parallel: the input features are split,
weight shard ``[out, in / tp]``; the partial outputs are summed by an all-reduce
in ``forward``. At tp size 1 both are a plain matmul.

Merged layers (QKV, gate+up) hold several logical matrices stacked along the
output dimension; ``load(shard_id, full_weight)`` copies this rank's slice of
one of them into place (``load_fused`` splits a checkpoint's own merged matrix,
Phi-3's ``qkv_proj``). A bias (Qwen2's q, k and v) is split with its rows; a
row-parallel layer's bias is added once, after the all-reduce.

Each layer multiplies through one ``LinearKernel``, chosen by ``prepack()`` (called once
after loading) from the weight's form: ``GGUFBlocksLinear`` (``quant.linear``),
``CFloat32Linear``, ``OneDNNLinear`` or ``TorchLinear`` (``F.linear``). On the CPU in
float32 that is ``cpu_kernels.matmul``, our C kernel, on the weight laid out once for
it, which then takes every input, one row or a prefill chunk: each output is one chain
of FMAs over the input features in order, so a token's result is the same bits
whatever else is in the step (docs/cpu.md). Without the kernels (no compiler, not x86
with AVX2, ``SPECSERVE_CPU_KERNELS=0``) the weight is reordered into oneDNN's blocked
layout with a batch-size hint of 16, whose skinny GEMM streams the weights faster than
``F.linear``; whether 1-3 rows run faster there padded to 4 depends on the CPU, so
``calibrate_min_rows`` times the model's own matmuls at start-up and picks. oneDNN's
result for a row may change in the last bits with the row count: that path promises
agreement within a tolerance, not bits.
"""

import time

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import cpu_kernels, quant
from engine.layers.parallel import SINGLE, TPGroup


PACK_BATCH_HINT = 16
PAD_CANDIDATES = (1, 2, 4)  # inputs with fewer rows than the chosen one are padded up to it


def can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class LinearKernel:
    """How a linear layer multiplies: ``kernel(x, weight)``, x [T, in] -> [T, out], ``weight``
    the layer's float weight [out, in] (meta under GGUF blocks). One is chosen per layer at
    load (``PackedLinear.prepack``), so a call never asks which form the weight is in."""

    kernel: cpu_kernels.KernelWeight | None = None  # the weight in cpu_kernels.matmul's panels
    qweight: quant.LinearArgs | None = None  # the weight's GGUF blocks, in quant.linear's panels

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TorchLinear(LinearKernel):
    """``F.linear`` on the weight as it is: a GPU, another dtype, no kernels nor oneDNN, or not yet prepacked."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


class CFloat32Linear(LinearKernel):
    """Our C matmul on the weight laid out once in its panels (``cpu_kernels.matmul``); an input
    it cannot take (in autograd) goes through ``F.linear``."""

    def __init__(self, weight: torch.Tensor):
        self.kernel = cpu_kernels.kernel_weight(weight)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.usable(x):
            return cpu_kernels.matmul(x, self.kernel)
        return F.linear(x, weight)


class OneDNNLinear(LinearKernel):
    """oneDNN's skinny GEMM on the weight reordered once into its blocked layout; inputs of fewer
    than ``min_rows`` rows padded to that many (set by ``calibrate_min_rows``)."""

    min_rows: int = 1

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows < self.min_rows:
            x = torch.cat([x, x.new_zeros(self.min_rows - rows, x.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return y[:rows] if rows < self.min_rows else y


class GGUFBlocksLinear(LinearKernel):
    """The weight kept in GGUF blocks, multiplied by ``quant.linear``."""

    def __init__(self, qweight: quant.LinearArgs):
        self.qweight = qweight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return quant.linear(x, self.qweight)


class PackedLinear(nn.Module):
    """A ``weight`` [out, in] applied as ``x @ weight.T`` by its ``LinearKernel``, chosen by
    ``prepack``; in GGUF blocks ``weight`` stays a meta tensor (shape only)."""

    weight: nn.Parameter
    bias: nn.Parameter | None  # [out] (this rank's rows of a column-parallel layer), or None
    linear_kernel: LinearKernel = TorchLinear()  # how matmul multiplies (set by prepack)

    def __init__(self):
        super().__init__()
        self.bias = None  # a subclass may make it a parameter
        self.quant_rows = quant.QuantRows()  # rows loaded in GGUF blocks (load_rows)

    @property
    def kernel(self) -> cpu_kernels.KernelWeight | None:
        """The weight in ``cpu_kernels.matmul``'s panels, where the layer multiplies so."""
        return self.linear_kernel.kernel

    @property
    def qweight(self) -> quant.LinearArgs | None:
        """The weight in GGUF blocks laid out for ``quant.linear``, where the layer multiplies so."""
        return self.linear_kernel.qweight

    def load_rows(self, first: int, rows) -> None:
        """Rows ``first ..`` of the weight from ``rows``: a float tensor (or lazy slice), or a
        ``QuantTensor``, kept in its blocks while the weight is still on meta (``quant.load_rows``)."""
        self.weight = quant.load_rows(self.weight, self.quant_rows, first, rows)

    def prepack(self, quantize: str | None = None) -> None:
        """Choose the layer's ``LinearKernel``, laying the weight out for it once: GGUF blocks where
        it was loaded so (``quantize``: a GGUF type to quantize a float weight to first), else on
        the CPU in float32 the C kernel, or without it oneDNN, else torch. Call after loading."""
        if quantize and self.weight.shape[1] % 32 == 0 and not self.weight.is_meta:
            self.quant_rows.add(0, quant.quantize(self.weight.data, quantize))
            self.weight = quant.meta_like(self.weight)
        if self.weight.is_meta:
            self.linear_kernel = GGUFBlocksLinear(self.quant_rows.pack(self.weight.shape[0]))
        elif not can_prepack(self.weight):
            self.linear_kernel = TorchLinear()
        elif cpu_kernels.load() is not None:
            self.linear_kernel = CFloat32Linear(self.weight.data)
        else:
            self.linear_kernel = OneDNNLinear(self.weight.data)

    def biased(self, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] plus the bias, where the layer has one (added after the product, whatever
        computed it, so that every kernel path gives the same sums)."""
        return y if self.bias is None else y + self.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        return self.linear_kernel(x, self.weight)


@torch.inference_mode()
def calibrate_min_rows(layers: list[PackedLinear], repeats: int = 5) -> int:
    """Times one row through every oneDNN-packed layer, padded to each of ``PAD_CANDIDATES``
    rows (interleaved, best of ``repeats``), and sets the fastest as every such layer's
    ``OneDNNLinear.min_rows``. Returns it (1 when nothing is packed: the C kernel needs no padding)."""
    packed = [(m.linear_kernel, m.weight.shape[1]) for m in layers if isinstance(m.linear_kernel, OneDNNLinear)]
    if not packed:
        return 1
    inputs = {(c, k): torch.randn(c, k) for c in PAD_CANDIDATES for _, k in packed}
    best = dict.fromkeys(PAD_CANDIDATES, float("inf"))
    for _ in range(repeats):
        for c in PAD_CANDIDATES:
            t = time.perf_counter()
            for m, k in packed:
                torch.ops.mkldnn._linear_pointwise(inputs[c, k], m.packed, None, "none", [], "")
            best[c] = min(best[c], time.perf_counter() - t)
    chosen = min(PAD_CANDIDATES, key=best.get)
    for m, _ in packed:
        m.min_rows = chosen
    return chosen


class ColumnParallelLinear(PackedLinear):
    """Output features split across ranks. ``out_sizes``: the full row count of each
    stacked logical matrix, split evenly; or ``parts``: this rank's ``(start, size)``
    rows of each (uneven splits, e.g. attention heads); ``full_sizes``: each logical
    matrix's full row count (needed by ``load_fused`` with ``parts``)."""

    def __init__(self, in_features: int, out_sizes: list[int] | None, tp: TPGroup = SINGLE, parts=None,
                 bias: bool = False, full_sizes: list[int] | None = None):
        super().__init__()
        self.tp = tp
        if parts is None:
            parts = [(tp.rank * s, s) for s in (tp.shard(n, "output features") for n in out_sizes)]
        self.parts = list(parts)
        self.out_sizes = [size for _, size in self.parts]
        self.full_sizes = full_sizes or out_sizes
        self.weight = nn.Parameter(torch.empty(sum(self.out_sizes), in_features), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(sum(self.out_sizes)), requires_grad=False)

    def load(self, shard_id: int, full, param: str = "weight") -> None:
        """Copy this rank's rows of logical matrix ``shard_id`` (or of its bias). ``full``
        [out_i, in] ([out_i]): a tensor or a lazy safetensors slice (only the rows taken are read)."""
        start, size = self.parts[shard_id]
        offset = sum(self.out_sizes[:shard_id])
        if param == "bias":
            self.bias.data[offset : offset + size].copy_(full[start : start + size])
        else:
            self.load_rows(offset, full[start : start + size])

    def load_fused(self, full, param: str = "weight") -> None:
        """Copy this rank's rows of every logical matrix from ``full``, the checkpoint's own
        stack of them [sum(full_sizes), in] (Phi-3's ``qkv_proj`` and ``gate_up_proj``)."""
        offset = 0
        for shard_id, rows in enumerate(self.full_sizes):
            ColumnParallelLinear.load(self, shard_id, RowsFrom(full, offset), param)  # ids 0, 1, ..
            offset += rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.biased(self.matmul(x))


class RowsFrom:
    """Rows ``offset ..`` of a tensor or lazy safetensors slice, indexed by row slices."""

    def __init__(self, full, offset: int):
        self.full, self.offset = full, offset

    def __getitem__(self, rows: slice):
        return self.full[rows.start + self.offset : rows.stop + self.offset]


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul; shard ids "q", "k", "v".

    Ranks take whole KV heads with their groups of query heads (``TPGroup.split``),
    so a model whose KV heads do not divide by the tensor-parallel size still
    splits: 3 KV heads over 2 ranks -> 2 and 1 (SmolLM2: 6 and 3 query heads)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: TPGroup = SINGLE,
                 bias: bool = False):
        kv_start, kv_count = tp.split(num_kv_heads, "num_key_value_heads")
        group = num_heads // num_kv_heads  # query heads per KV head
        q = (kv_start * group * head_dim, kv_count * group * head_dim)
        kv = (kv_start * head_dim, kv_count * head_dim)
        full = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden, None, tp, parts=[q, kv, kv], bias=bias, full_sizes=full)

    def load(self, shard_id, full, param: str = "weight") -> None:
        super().load("qkv".index(shard_id), full, param)


class RowParallelLinear(PackedLinear):
    """Input features split across ranks (``part``: this rank's ``(start, size)``;
    default an even split); the partial outputs are summed in ``forward``, or, with
    ``reduce=False``, by the caller (a mixture of experts sums all its experts at once;
    it adds the bias then)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup = SINGLE, part=None, bias: bool = False,
                 reduce: bool = True):
        super().__init__()
        self.tp, self.reduce = tp, reduce
        if part is None:
            size = tp.shard(in_features, "input features")
            part = (tp.rank * size, size)
        self.in_start, self.in_shard = part
        self.weight = nn.Parameter(torch.empty(out_features, self.in_shard), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False)

    def load(self, shard_id, full, param: str = "weight") -> None:
        if param == "bias":
            self.bias.data.copy_(full[:])
        else:
            self.load_rows(0, full[:, self.in_start : self.in_start + self.in_shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce:
            return self.matmul(x)
        return self.biased(self.tp.all_reduce(self.matmul(x)))


class ReplicatedLinear(PackedLinear):
    """The whole weight [out, in] on every rank (a router: each rank routes every token alike)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def load(self, shard_id, full, param: str = "weight") -> None:
        self.load_rows(0, full[:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split across ranks."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.shard_size = tp.shard(vocab_size, "vocab_size")
        self.start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden), requires_grad=False)
        self.quant_rows = quant.QuantRows()  # the shard in GGUF blocks (``weight`` then stays on meta)

    def load(self, shard_id, full, param: str = "weight") -> None:
        self.weight = quant.load_rows(self.weight, self.quant_rows, 0, full[self.start : self.start + self.shard_size])

    def tie(self, head: "ParallelLMHead") -> None:
        """``head`` multiplies by this embedding's weight, however it is loaded (call again once it
        is: loading may replace the weight)."""
        head.weight, head.quant_rows = self.weight, self.quant_rows

    def pack_quantized(self) -> None:
        """Lay quantized rows out for the kernels (``QuantRows.pack``); call after loading."""
        if self.weight.is_meta:
            self.quant_rows.pack(self.shard_size)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] (in this shard) -> rows [T, hidden]; quantized rows dequantized by the kernels."""
        if not self.weight.is_meta:
            return F.embedding(ids, self.weight)
        return self.quant_rows.pack(self.shard_size).lookup(ids.cpu()).to(ids.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard_size)
        out = self.lookup(local.clamp(0, self.shard_size - 1)) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, PackedLinear):
    """Output projection over a vocab-sharded weight; gathers the full logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last_dim(self.matmul(hidden))
