"""CUDA graphs and kernel launches on fake CUDA (``tests.gpu_fake.fake_cuda``).

``kernels()`` tallies the CUDA kernels a region dispatches: every top-level aten op (or a
library's own op, flash-attn's) with a CUDA tensor, less views and bare allocations, which
launch nothing. Ops that a library op runs inside itself are not counted again.

``fake_graphs(gpu)`` stands in for ``torch.cuda.CUDAGraph``, ``torch.cuda.graph`` and
``torch.cuda.graph_pool_handle`` as a CUDA graph behaves: capture runs the region once and
records its kernels with their tensors; ``replay()`` runs the recorded kernels again on the
same tensors (an out-of-place kernel's result is copied into the tensor captured as its
output), so host values read during capture stay baked in, as on a GPU. Capture FAILS
(``GraphUnsafe``) when the region syncs with the host (``.item()``, ``.tolist()``,
``bool()``, a device-to-host copy, a data-dependent shape), calls a synchronize, or copies
host data to the device: what a real capture rejects or replays wrongly. Memory: the graphs
share one pool holding the largest capture's peak (``_into_pool``). Not modelled: allocations
outside the graph's pool, streams, and the real capture's speed.
"""

import contextlib
from collections import Counter
from unittest import mock

import torch
from torch._subclasses.fake_tensor import _DISPATCH_HANDLE_DIRECTLY, _DISPATCH_META_HANDLERS, FakeTensor

from tests.gpu_fake.fake_ops import FakeCudaMode, _tensors, _values, value

aten = torch.ops.aten
_NO_KERNEL = {aten._unsafe_view.default,  # a view that autograd does not track
                aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                aten.new_empty.default, aten.new_empty_strided.default}
_ORIGINAL = FakeCudaMode.dispatch
_listeners: list = []  # callables (func, args, kwargs, out), told of each kernel
_depth = 0  # dispatch nesting: a library op's own inner ops are not kernels of their own


class GraphUnsafe(RuntimeError):
    """The captured region did what a CUDA graph cannot hold."""


def _is_kernel(func, args, kwargs) -> bool:
    if (func.is_view or func in _NO_KERNEL or func.namespace in ("prim", "prims")
            or func in _DISPATCH_META_HANDLERS or func in _DISPATCH_HANDLE_DIRECTLY):  # metadata: .device, sizes
        return False
    cuda_arg = any(isinstance(t, FakeTensor) for t in _tensors(args, kwargs))
    device = kwargs.get("device")
    return cuda_arg or (device is not None and torch.device(device).type == "cuda")


def _dispatch(self, func, types, args=(), kwargs=None):
    global _depth
    _depth += 1
    try:
        out = _ORIGINAL(self, func, types, args, kwargs)
    finally:
        _depth -= 1
    if _depth == 0 and _listeners and _is_kernel(func, args, kwargs or {}):
        for listener in _listeners:
            listener(func, args, kwargs or {}, out)
    return out


@contextlib.contextmanager
def _listening(listener):
    with mock.patch.object(FakeCudaMode, "dispatch", _dispatch):
        _listeners.append(listener)
        try:
            yield
        finally:
            _listeners.remove(listener)


@contextlib.contextmanager
def kernels():
    """Yields a Counter (op name -> kernels dispatched) filled while the region runs."""
    counts = Counter()
    with _listening(lambda func, *_: counts.update([func.name()])):
        yield counts


class FakeGraph:
    """``torch.cuda.CUDAGraph`` under the harness (see the module doc). Kernels are kept on
    their tensors' values (CPU tensors), so the fake tensors of the region free as they
    would eagerly: the harness's memory then counts the region's peak, as a graph's pool
    holds it. A library's own op (flash-attn's) is kept on its fake tensors."""

    def __init__(self, gpu):
        self.gpu, self.ops, self.replays = gpu, [], 0

    def record(self, func, args, kwargs, out) -> None:
        if func.namespace == "aten":
            args, kwargs, out = _values(args), _values(kwargs), _values(out)
        self.ops.append((func, args, kwargs, out))

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for captured, fresh in zip(_leaves(out), _leaves(new)):
                if captured is not fresh:
                    value(captured).copy_(value(fresh))


def _leaves(x) -> list:
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _leaves(y)]
    return [x] if isinstance(x, torch.Tensor) else []


@contextlib.contextmanager
def _capture(graph: FakeGraph, pool=None, **_kw):
    """``torch.cuda.graph(graph)``: records the region's kernels; raises ``GraphUnsafe`` on
    a host sync, a synchronize or a host-to-device copy inside it."""
    gpu, counts = graph.gpu, graph.gpu.counts
    before = (counts.syncs.copy(), counts.synchronize, counts.h2d_async + counts.h2d_blocking)
    pool = getattr(gpu, "pool", 0)
    gpu.allocated -= pool  # the capture allocates from the graphs' pool first
    storages, allocated, peak = set(gpu._storages), gpu.allocated, gpu.peak
    gpu.peak = allocated
    with _listening(graph.record):
        yield
    _into_pool(gpu, storages, gpu.peak - allocated, pool)
    gpu.peak = max(peak, gpu.peak, gpu.allocated)
    problems = [f"{n} host sync(s): {reason}" for reason, n in (counts.syncs - before[0]).items()]
    if counts.synchronize != before[1]:
        problems.append(f"{counts.synchronize - before[1]} synchronize call(s)")
    if counts.h2d_async + counts.h2d_blocking != before[2]:
        problems.append(f"{counts.h2d_async + counts.h2d_blocking - before[2]} host-to-device copies")
    if problems:
        raise GraphUnsafe("the captured region " + "; ".join(problems))


def _into_pool(gpu, before: set, need: int, pool: int) -> None:
    """The graphs' one pool: the storages a capture left alive (its outputs) stop counting
    one by one; the pool holds the largest capture's peak (``need``) instead."""
    for key in set(gpu._storages) - before:
        gpu.allocated -= gpu._storages[key][0]
        gpu._storages[key][0] = 0  # its release gives nothing back: the pool keeps it
    gpu.pool = max(pool, need)
    gpu.allocated += gpu.pool


@contextlib.contextmanager
def fake_graphs(gpu):
    """``torch.cuda``'s graph API as ``FakeGraph``s; yields the graphs made."""
    made: list[FakeGraph] = []

    def make():
        made.append(FakeGraph(gpu))
        return made[-1]

    with mock.patch.multiple(torch.cuda, CUDAGraph=make, graph=_capture, graph_pool_handle=lambda: object()):
        yield made
