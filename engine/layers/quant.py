"""Weights kept in GGUF's block formats, multiplied on the CPU by our C kernels.

A quantized linear layer is loaded as ``QuantWeight`` parts stacked along the output
features (a fused QKV of a Q4_K_M file: Q4_K rows for q and k, Q6_K for v), each part the
file's own blocks, row by row, never dequantized. ``LinearArgs`` lays each part out once in
the kernels' panels (``panel``: the same codes and scales, 8 rows interleaved; the K-quants'
packed scales unpacked, Q5_K and Q6_K codes one a byte) and ``linear`` multiplies float32
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
    the AVX-512 build, in 512-bit vectors where it has AVX-512 BW too; else AVX-VNNI)."""
    flags, cpu = cpu_kernels.compile_flags() + ("-mf16c",), cpu_kernels.cpu_flags()
    if "-mavx512f" in flags and " avx512_vnni" in cpu and " avx512vl" in cpu:
        return flags + ("-mavx512vl", "-mavx512vnni") + (("-mavx512bw",) if " avx512bw" in cpu else ())
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
    lib.quant_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int] + [ctypes.c_void_p] * 4 + [
        ctypes.c_int]
    lib.panel_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p]
    lib.panel_rows.restype = None
    lib.panel_bytes.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.panel_bytes.restype = ctypes.c_int64
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


# ---- panels: the kernels' layout of a weight (csrc/quant_kernels.c, "weight panels") ----


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of every block [..., 1] (uint16: its bits)."""
    return np.ascontiguousarray(blocks[..., at : at + 2]).view(np.uint16)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 12 packed bytes of a 256-weight block -> 6-bit scales and mins [..., 8]."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


def _fields(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """GGUF blocks [N, nb, size] -> codes [N, K / 32, 32] (uint8; int8 for Q8_0 / Q6_K), the
    per-chunk scale fields [N, K / 32, bytes] and the per-256 header fields [N, K / 256, bytes]
    of the panel layout, each as it lies in the file."""
    n, nb, _ = blocks.shape
    nibbles = lambda qs: np.stack([qs & 15, qs >> 4], axis=-2)  # noqa: E731  [..., 16] -> [..., 2, 16]
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        start = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}[kind]
        codes = blocks[..., start:] if kind == "Q8_0" else nibbles(blocks[..., start:]).reshape(n, nb, 32)
        scales = [_f16(blocks, 0)] + ([_f16(blocks, 2)] if kind == "Q4_1" else [])
        return codes, scales, []
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(blocks[..., 4:16])
        qs = blocks[..., 16:144] if kind == "Q4_K" else blocks[..., 48:176]
        codes = nibbles(qs.reshape(n, nb, 4, 32)).reshape(n, nb, 8, 32)  # chunk 2i: low nibbles, 2i + 1: high
        if kind == "Q5_K":
            high = (blocks[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [n, nb, 8, 32]
            codes = codes | (high << 4)
        return codes.reshape(n, nb * 8, 32), [sc.reshape(n, nb * 8, 1), mn.reshape(n, nb * 8, 1)], \
            [_f16(blocks, 0), _f16(blocks, 2)]
    # Q6_K: ql [128], qh [64], scales [16] int8, d
    ql = nibbles(blocks[..., 0:128].reshape(n, nb, 2, 2, 32)).transpose(0, 1, 2, 4, 3, 5)  # [n, nb, h, nib, 2, 32]
    qh = (blocks[..., None, 128:192].reshape(n, nb, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    codes = (ql.reshape(n, nb, 2, 4, 32) | (qh << 4)).astype(np.int16) - 32
    return codes.astype(np.int8).reshape(n, nb * 8, 32), [blocks[..., 192:208].reshape(n, nb * 8, 2)], \
        [_f16(blocks, 208)]


def _by_row(field: np.ndarray, groups: int) -> np.ndarray:
    """A field [8 G, X, c] (one value per row, c per chunk) -> bytes [G, X, c x 8 rows x its size]:
    for each of its c values, the 8 rows' side by side."""
    x, c = field.shape[1:]
    by_row = np.ascontiguousarray(field.reshape(groups, 8, x, c).transpose(0, 2, 3, 1))
    return by_row.view(np.uint8).reshape(groups, x, -1)


def panel(w: QuantWeight) -> torch.Tensor:
    """The weight in the kernels' panels: groups of 8 rows (zero rows past the end), each
    [panel bytes] (``panel_bytes``), the file's codes and scales interleaved row by row."""
    block, size = GGML_QUANT_SIZES[type_of(w.kind)]
    n, groups = w.out_features, -(-w.out_features // 8)
    blocks = np.zeros((groups * 8, w.in_features // block, size), dtype=np.uint8)
    blocks[:n] = w.data.numpy().reshape(n, -1, size)
    codes, scales, header = _fields(w.kind, blocks)
    chunks = codes.shape[1]
    # [G, 8 rows, chunks, 8 quads, 4] -> [G, chunks, 8 quads, 8 rows, 4]
    quads = codes.view(np.uint8).reshape(groups, 8, chunks, 8, 4).transpose(0, 2, 3, 1, 4)
    if w.kind in ("Q4_0", "Q4_1", "Q4_K"):
        quads = quads[:, :, :4] | (quads[:, :, 4:] << 4)  # quad j low, j + 4 high
    chunk = np.concatenate([quads.reshape(groups, chunks, -1)] + [_by_row(f, groups) for f in scales], axis=-1)
    if header:
        heads = [_by_row(f, groups) for f in header]
        chunk = np.concatenate(heads + [chunk.reshape(groups, chunks // 8, -1)], axis=-1)
    out = torch.from_numpy(np.ascontiguousarray(chunk).reshape(groups, -1))
    assert out.shape[1] == load().panel_bytes(int(type_of(w.kind)), w.in_features)
    return out


class _Matrix(ctypes.Structure):  # csrc/specserve_kernels.h, quant_matrix
    _fields_ = [("parts", ctypes.c_int), ("fmts", ctypes.c_void_p), ("ws", ctypes.c_void_p), ("ns", ctypes.c_void_p)]


class LinearArgs:
    """The constant arguments of ``quant_linear`` for one layer's parts, laid out in panels once
    (the file's bytes are then dropped), and ``handle``: the address of the same as one C struct
    (``layer_matmul``'s weight)."""

    def __init__(self, parts: tuple[QuantWeight, ...]):
        n = len(parts)
        self.kinds = [p.kind for p in parts]
        self.panels = [panel(p) for p in parts]  # the C calls read them by address
        self.count = n
        self.fmts = (ctypes.c_int * n)(*(int(type_of(p.kind)) for p in parts))
        self.ptrs = (ctypes.c_void_p * n)(*(t.data_ptr() for t in self.panels))
        self.rows = (ctypes.c_int64 * n)(*(p.out_features for p in parts))
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.matrix = _Matrix(n, *(ctypes.addressof(a) for a in (self.fmts, self.ptrs, self.rows)))
        self.handle = ctypes.addressof(self.matrix)


    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] of a one-part weight, dequantized: [T, in_features] float32."""
        assert self.count == 1
        return self._rows(0, ids)

    def dequantize(self) -> torch.Tensor:
        """The whole weight [out_features, in_features] in float32, its parts stacked."""
        return torch.cat([self._rows(i, torch.arange(self.rows[i])) for i in range(self.count)])

    def _rows(self, part: int, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], self.in_features)
        load().panel_rows(self.fmts[part], self.ptrs[part], self.in_features, ids.data_ptr(), ids.shape[0],
                          out.data_ptr())
        return out


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
    rc = load().quant_linear(x.data_ptr(), m, k, args.count, args.fmts, args.ptrs, args.rows, y.data_ptr(),
                             torch.get_num_threads())
    cpu_kernels.check(rc, f"quant_linear (formats {args.kinds})")
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
    """The rows of a layer's weight loaded in GGUF blocks: ``(first row, QuantWeight)`` parts,
    until ``pack`` lays them out for the kernels."""

    def __init__(self):
        self.parts: list[tuple[int, QuantWeight]] = []
        self.packed: LinearArgs | None = None

    def add(self, first_row: int, weight: QuantWeight) -> None:
        self.parts.append((first_row, weight))

    def pack(self, rows: int) -> LinearArgs:
        """The parts stacked in row order and laid out in panels, once (the file's bytes are
        dropped: a tied embedding reads the panels too); ValueError unless they are exactly
        ``rows`` rows."""
        if self.packed is None:
            parts = sorted(self.parts, key=lambda p: p[0])
            ends = [0] + [first + w.out_features for first, w in parts]
            if [first for first, _ in parts] != ends[:-1] or ends[-1] != rows:
                spans = [(f, e) for (f, _), e in zip(parts, ends[1:])]
                raise ValueError(f"a quantized weight of {rows} rows was loaded as rows {spans}")
            self.packed, self.parts = LinearArgs(merge([w for _, w in parts])), []
        return self.packed

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
