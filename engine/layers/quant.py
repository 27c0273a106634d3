"""Weights kept in GGUF's block formats, multiplied on the CPU by our C kernels.

A quantized linear layer holds its weight as ``QuantWeight`` parts stacked along the
output features (a fused QKV of a Q4_K_M file: Q4_K rows for q and k, Q6_K for v), each
part the file's own blocks, row by row, never dequantized. ``linear`` multiplies float32
activations by all the parts in one call: the activations are quantized to 8 bits per
block of 32 (as llama.cpp does) and meet the weights in integer multiply-adds
(``csrc/quant_kernels.c``: why, and what stays exact). A row's result is the same bits
whatever the other rows of the step are, at every row count.

The library is built like the other CPU kernels (``cpu_kernels.compile_library``) and is
on where they are: x86-64 with AVX2 + FMA, a C compiler, and ``SPECSERVE_CPU_KERNELS`` not
0. AVX-512 CPUs with VNNI (or AVX-VNNI ones) multiply with ``dpbusd`` for the same integers.
Elsewhere ``load()`` is None and the loader dequantizes to float at start-up.
"""

import ctypes
import functools
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from engine.layers import cpu_kernels

log = logging.getLogger(__name__)

SOURCE = cpu_kernels.CSRC / "quant_kernels.c"
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # the formats the C kernels multiply


def compile_flags() -> tuple[str, ...]:
    """The CPU kernels' flags, plus F16C, and VNNI where the CPU has it (AVX-512 VNNI with
    the AVX-512 build, else AVX-VNNI)."""
    flags, cpu = cpu_kernels.compile_flags() + ("-mf16c",), cpu_kernels.cpu_flags()
    if "-mavx512f" in flags and " avx512_vnni" in cpu and " avx512vl" in cpu:
        return flags + ("-mavx512vl", "-mavx512vnni")
    if " avx_vnni" in cpu and os.environ.get("SPECSERVE_CPU_VNNI", "1") != "0":
        return flags + ("-mavxvnni",)
    return flags


@functools.cache
def load():
    """The compiled library, or None where the CPU kernels are off."""
    if cpu_kernels.load() is None:
        return None
    try:
        return build(cpu_kernels.compiler(), compile_flags())
    except (OSError, cpu_kernels.subprocess.SubprocessError) as e:
        log.warning("could not build the quantized-matmul kernels (%s): GGUF weights are dequantized", e)
        return None


def build(compiler: str, flags: tuple[str, ...]):
    """The library compiled with ``flags`` (cached on disk), its functions typed."""
    lib = ctypes.CDLL(str(cpu_kernels.compile_library("quant_kernels", [SOURCE], compiler, flags)))
    lib.quant_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int] + [ctypes.c_void_p] * 5 + [
        ctypes.c_int]
    lib.quant_linear.restype = ctypes.c_int
    lib.quantize_q8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3
    lib.quantize_q8.restype = None
    return lib


def type_of(kind: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[kind]


def row_bytes(kind: str, in_features: int) -> int:
    block, size = GGML_QUANT_SIZES[type_of(kind)]
    return in_features // block * size


@dataclass(frozen=True, eq=False)  # compared by identity: never tensor by tensor
class QuantWeight:
    """A weight [out_features, in_features] in GGUF block format ``kind`` (a GGMLQuantizationType
    name): ``data`` [out_features, row_bytes] uint8, each row its blocks along in_features."""

    kind: str
    data: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (or its ``rows``, an index tensor) as float32 [rows, in_features]."""
        data = self.data if rows is None else self.data[rows]
        return dequantize(data, self.kind, self.in_features)


def dequantize(data: torch.Tensor, kind: str, in_features: int) -> torch.Tensor:
    """Block bytes [rows, row_bytes] -> float32 [rows, in_features], by the gguf package's own rule."""
    values = quants.dequantize(np.ascontiguousarray(data.numpy()), type_of(kind))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(data.shape[0], in_features)


def merge(parts: list[QuantWeight]) -> tuple[QuantWeight, ...]:
    """Adjacent parts of one format joined into one (fewer kernel calls): the same matrix."""
    out: list[QuantWeight] = []
    for p in parts:
        if out and out[-1].kind == p.kind and out[-1].in_features == p.in_features:
            out[-1] = QuantWeight(p.kind, torch.cat([out[-1].data, p.data]), p.in_features)
        else:
            out.append(p)
    return tuple(out)


class _Matrix(ctypes.Structure):  # csrc/quant_kernels.c, quant_matrix
    _fields_ = [("parts", ctypes.c_int), ("fmts", ctypes.c_void_p), ("ws", ctypes.c_void_p),
                ("row_bytes", ctypes.c_void_p), ("ns", ctypes.c_void_p)]


class LinearArgs:
    """The constant arguments of ``quant_linear`` for one layer's parts, built once; ``handle``:
    the address of the same as one C struct (``layer_matmul``'s weight handle)."""

    def __init__(self, parts: tuple[QuantWeight, ...]):
        n = len(parts)
        self.parts = parts  # keeps the tensors alive
        self.count = n
        self.fmts = (ctypes.c_int * n)(*(int(type_of(p.kind)) for p in parts))
        self.ptrs = (ctypes.c_void_p * n)(*(p.data.data_ptr() for p in parts))
        self.row_bytes = (ctypes.c_int64 * n)(*(p.data.stride(0) for p in parts))
        self.rows = (ctypes.c_int64 * n)(*(p.out_features for p in parts))
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.matrix = _Matrix(n, *(ctypes.addressof(a) for a in (self.fmts, self.ptrs, self.row_bytes, self.rows)))
        self.handle = ctypes.addressof(self.matrix)


def layer_matmul() -> int:
    """The address of the C matmul that ``cpu_kernels.decoder_layer`` calls with ``LinearArgs.handle``s."""
    return ctypes.cast(load().quant_layer_matmul, ctypes.c_void_p).value


def linear(x: torch.Tensor, args: LinearArgs) -> torch.Tensor:
    """x [M, in] float32 -> x @ W.T [M, out] for the stacked parts of ``args`` (``load()``
    must not be None). Each row's result is the same bits whatever the other rows are."""
    x = x.contiguous()
    m, k = x.shape
    assert k == args.in_features and x.dtype == torch.float32
    y = torch.empty(m, args.out_features, dtype=torch.float32)
    rc = load().quant_linear(x.data_ptr(), m, k, args.count, args.fmts, args.ptrs, args.row_bytes, args.rows,
                             y.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"quant_linear failed ({rc}): formats {[p.kind for p in args.parts]}")
    return y


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> the kernels' own 8-bit codes [M, K] int8, scales [M, K / 32] and
    code sums [M, K / 32]: what ``linear`` multiplies the weights by."""
    x = x.contiguous()
    m, k = x.shape
    q, dx, isum = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // 32), torch.empty(m, k // 32)
    load().quantize_q8(x.data_ptr(), m, k, q.data_ptr(), dx.data_ptr(), isum.data_ptr())
    return q, dx, isum


@dataclass(frozen=True)
class QuantTensor:
    """A checkpoint matrix [rows, cols] in GGUF block format ``kind``; ``data`` [rows, row_bytes] uint8.

    Sliced as the parallel layers slice a checkpoint tensor: ``t[a:b]`` takes rows,
    ``t[:, a:b]`` columns, by whole blocks (a cut through blocks gives float32 instead)."""

    kind: str
    data: torch.Tensor
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    def __getitem__(self, index) -> "QuantTensor":
        if not isinstance(index, tuple):
            return QuantTensor(self.kind, self.data[index], self.cols)
        rows, cols = index
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[self.kind]]
        start, stop, _ = cols.indices(self.cols)
        if start % block or stop % block:  # a tensor-parallel shard that cuts blocks: served in float
            log.warning("columns %d:%d of a %s tensor cut its blocks of %d: dequantized", start, stop, self.kind, block)
            return self.dequantize()[rows, start:stop]
        return QuantTensor(self.kind, self.data[rows, start // block * size : stop // block * size], stop - start)

    def weight(self) -> QuantWeight:
        return QuantWeight(self.kind, self.data.contiguous(), self.cols)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.data, self.kind, self.cols)


class QuantRows:
    """The rows of a layer's weight loaded in GGUF blocks: ``(first row, QuantWeight)`` parts."""

    def __init__(self):
        self.parts: list[tuple[int, QuantWeight]] = []

    def add(self, first_row: int, weight: QuantWeight) -> None:
        self.parts.append((first_row, weight))

    def args(self, rows: int) -> LinearArgs:
        """The parts stacked in row order for ``linear``; ValueError unless they are exactly ``rows`` rows."""
        parts = sorted(self.parts, key=lambda p: p[0])
        ends = [0] + [first + w.out_features for first, w in parts]
        if [first for first, _ in parts] != ends[:-1] or ends[-1] != rows:
            raise ValueError(f"a quantized weight of {rows} rows was loaded as rows {[(f, e) for (f, _), e in zip(parts, ends[1:])]}")
        return LinearArgs(merge([w for _, w in parts]))

    def dequantize_into(self, weight: torch.Tensor) -> None:
        for first, w in self.parts:
            weight[first : first + w.out_features].copy_(w.dequantize())
        self.parts.clear()


def meta_like(weight: torch.Tensor) -> nn.Parameter:
    """A parameter with ``weight``'s shape and no memory: what a quantized layer keeps as ``weight``."""
    return nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)


def load_rows(weight: nn.Parameter, held: QuantRows, first: int, rows) -> nn.Parameter:
    """Loads rows ``first ..`` of a layer's ``weight``; returns the weight to keep. A ``QuantTensor``
    stays in its blocks (``held``) while the weight is on meta (the loader leaves it there for a
    GGUF file served quantized). Float rows (a float tensor or a lazy slice) are copied; the first
    ones into a meta weight make it a float32 CPU one, the quantized rows so far dequantized into it:
    a layer is served quantized only if all of it came quantized."""
    if isinstance(rows, QuantTensor) and weight.is_meta:
        held.add(first, rows.weight())
        return weight
    if weight.is_meta:
        weight = nn.Parameter(torch.full(weight.shape, float("nan")), requires_grad=False)
        held.dequantize_into(weight.data)
    weight.data[first : first + rows.shape[0]].copy_(rows.dequantize() if isinstance(rows, QuantTensor) else rows[:])
    return weight


def quantize(weight: torch.Tensor, kind: str) -> QuantWeight:
    """weight [out, in] (in a multiple of 32) -> its blocks in ``kind`` (Q8_0, Q4_0 or Q4_1), by
    the gguf package's own rule (what llama.cpp's converter writes)."""
    data = quants.quantize(weight.detach().float().contiguous().numpy(), type_of(kind))
    return QuantWeight(kind, torch.from_numpy(np.ascontiguousarray(data)), weight.shape[1])


# --quantization of a float checkpoint: the GGUF type of the layers, and of the output head
QUANTIZE_TO = {"int8": ("Q8_0", "Q8_0"), "int4": ("Q4_1", "Q8_0")}
