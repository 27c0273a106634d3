"""Fake CUDA on a CPU build of torch: the CUDA paths run in the CPU suite.

``with fake_cuda() as gpu:`` lets code create and use ``device="cuda"`` tensors:

- Every CUDA tensor is a ``FakeTensor`` (``torch._subclasses.fake_tensor``, under a
  ``FakeTensorMode``) that carries its values, computed by the same op on the CPU
  (``value(t)``); CPU tensors stay real. So ``.item()``, ``.tolist()``, ``.cpu()`` and
  data-dependent shapes work, and samplers really sample.
- Device mixing raises as on CUDA: one device per op, CPU scalars excepted, CPU index
  tensors allowed to index a CUDA tensor; a CPU generator on a CUDA tensor (and the
  reverse) raises too. ``fake_cuda(strict=True)`` also runs torch's own fake kernel of
  every CUDA op, with its shape and device checks (several times slower).
- ``gpu.counts`` tallies what would stall or copy on a GPU: implicit host syncs
  (``.item()``, ``.tolist()``, ``bool()``, device-to-host copies, data-dependent
  shapes; by reason), ``torch.cuda.synchronize`` calls, and host-to-device copies,
  asynchronous (pinned source, ``non_blocking=True``) or not. ``pin_memory`` is
  recorded, not done (a CPU build cannot pin).
- ``torch.cuda``'s query, memory and synchronization functions are patched: memory is
  what the live fake CUDA tensors hold (``gpu.allocated``, ``gpu.peak``) on a device of
  ``total_bytes``; ``torch.Generator("cuda")`` is a CPU generator that says it is on CUDA.
- CUDA graphs are captured and replayed by ``tests.gpu_fake.fake_graphs`` (``gpu.graphs``:
  the graphs made), whose capture fails on a host sync or copy inside the region.

What it cannot show: speed, kernels that exist only in CUDA builds (they fail to
dispatch, which a test sees), stream races, and the numerics of CUDA kernels (the
values are the CPU kernels').
"""

import contextlib
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor

from tests.gpu_fake.fake_graphs import fake_graphs
from tests.gpu_fake.fake_ops import CUDA, FakeCudaMode, PythonBindings, fake_tolist, set_value, value

_REAL_GENERATOR = torch.Generator
_TRACKED = "_fake_cuda_tracked"  # the attribute of a fake that holds the finalizer giving its bytes back

__all__ = ["CUDA", "Counts", "FakeCuda", "cuda_api", "fake_cuda", "value"]


@dataclass
class Counts:
    """What a GPU would stall or copy for, since the harness started (or ``reset``)."""

    syncs: Counter = field(default_factory=Counter)  # reason -> implicit host syncs
    synchronize: int = 0  # explicit torch.cuda.synchronize() / Event.synchronize() / Stream.synchronize()
    h2d_async: int = 0  # host-to-device copies from pinned memory with non_blocking=True
    h2d_blocking: int = 0  # every other host-to-device copy (pageable source, or blocking)

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())

    def reset(self) -> None:
        self.syncs.clear()
        self.synchronize = self.h2d_async = self.h2d_blocking = 0


class FakeCudaGenerator(_REAL_GENERATOR):
    """What ``torch.Generator("cuda")`` gives under the harness: a CPU generator
    (the values are computed on the CPU) that reports the CUDA device."""

    @property
    def device(self) -> torch.device:
        return CUDA


class _Generator(_REAL_GENERATOR):
    """``torch.Generator`` under the harness: a class still (annotations such as
    ``torch.Generator | None`` evaluate), whose CUDA instances are ``FakeCudaGenerator``s."""

    def __new__(cls, device="cpu"):
        return FakeCudaGenerator() if torch.device(device).type == "cuda" else _REAL_GENERATOR(device)


class FakeCuda:
    """The harness's handle: counts, memory, and the patched ``torch.cuda``."""

    def __init__(self, total_bytes: int = 141 << 30, device_count: int = 1, name: str = "NVIDIA H200 (fake)",
                 strict: bool = False):
        self.total_bytes, self.device_count, self.name = total_bytes, device_count, name
        self.counts = Counts()
        self.allocated = self.peak = 0
        self._storages: dict[int, list[int]] = {}  # storage id -> [bytes, live fakes on it]
        self._pinned: list[torch.Tensor] = []  # held for the harness's life: no address reuse
        self.mode = FakeCudaMode(self, strict)

    # -- counts --
    def sync(self, reason: str) -> None:
        self.counts.syncs[reason] += 1

    def h2d(self, src: torch.Tensor, non_blocking: bool) -> None:
        if non_blocking and self.is_pinned(src):
            self.counts.h2d_async += 1
        else:
            self.counts.h2d_blocking += 1

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        self._pinned.append(t)
        return t

    def is_pinned(self, t: torch.Tensor) -> bool:
        if isinstance(t, FakeTensor) or t.device.type != "cpu":
            return False
        p = t.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() <= p < b.untyped_storage().data_ptr() + b.untyped_storage().nbytes()
                   for b in self._pinned)

    # -- memory: bytes of the storages that live fake CUDA tensors hold (their values') --
    def track(self, fake: FakeTensor) -> None:
        if hasattr(fake, _TRACKED) or fake.device.type != "cuda":
            return
        storage = value(fake).untyped_storage()  # views share their base's values, so their storage
        key = storage.data_ptr()
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [storage.nbytes(), 0]
            self.allocated += entry[0]
            self.peak = max(self.peak, self.allocated)
        entry[1] += 1
        setattr(fake, _TRACKED, weakref.finalize(fake, self._release, key))

    def retrack(self, fake: FakeTensor, real: torch.Tensor) -> None:
        """``fake.data = ...`` gave ``fake`` another storage, whose values are ``real``."""
        set_value(fake, real)
        finalizer = getattr(fake, _TRACKED, None)
        if finalizer is not None:
            detached = finalizer.detach()  # (obj, func, args, kwargs), None when already run
            if detached is not None:
                self._release(*detached[2])
            delattr(fake, _TRACKED)
        self.track(fake)

    def _release(self, key: int) -> None:
        entry = self._storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.allocated -= entry[0]
            del self._storages[key]

    def reset_peak(self, *_args) -> None:
        self.peak = self.allocated

    def mem_get_info(self, *_args) -> tuple[int, int]:
        return self.total_bytes - self.allocated, self.total_bytes

    def synchronize(self, *_args) -> None:
        self.counts.synchronize += 1

    def properties(self, *_args):
        return SimpleNamespace(name=self.name, total_memory=self.total_bytes, major=9, minor=0, multi_processor_count=132)

    def patches(self) -> dict:
        """The ``torch.cuda`` functions replaced while the harness is on (classes stay
        classes: annotations such as ``torch.cuda.Stream | None`` evaluate)."""
        gpu = self

        class Event(_Event):
            def __init__(self, *_args, **_kw):
                super().__init__(gpu)

        class Stream(_Stream):
            def __init__(self, *_args, **_kw):
                super().__init__(gpu)

        return dict(
            is_available=lambda: True, device_count=lambda: gpu.device_count, current_device=lambda: 0,
            set_device=lambda *_: None, get_device_name=lambda *_: gpu.name, get_device_properties=gpu.properties,
            get_device_capability=lambda *_: (9, 0), is_bf16_supported=lambda *_a, **_k: True,
            synchronize=gpu.synchronize, mem_get_info=gpu.mem_get_info, memory_allocated=lambda *_: gpu.allocated,
            max_memory_allocated=lambda *_: gpu.peak, memory_reserved=lambda *_: gpu.allocated,
            max_memory_reserved=lambda *_: gpu.peak, reset_peak_memory_stats=gpu.reset_peak, empty_cache=lambda: None,
            Event=Event, Stream=Stream, current_stream=lambda *_: Stream(), stream=lambda *_: contextlib.nullcontext(),
            device=_DeviceGuard,
        )


class _Event:
    """``torch.cuda.Event``: records host time; ``synchronize`` counts."""

    def __init__(self, gpu: FakeCuda):
        self.gpu, self.t = gpu, None

    def record(self, *_args) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        self.gpu.counts.synchronize += 1

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_Event") -> float:
        return (end.t - self.t) * 1000.0


class _DeviceGuard(contextlib.nullcontext):
    """``torch.cuda.device(index)``: one device, nothing to switch (a CPU build cannot)."""


class _Stream:
    def __init__(self, gpu: FakeCuda):
        self.gpu = gpu

    def synchronize(self) -> None:
        self.gpu.counts.synchronize += 1

    def wait_stream(self, _other) -> None:
        pass


@contextlib.contextmanager
def fake_cuda(strict: bool = False, **kw):
    """The harness (see the module doc); ``kw`` go to ``FakeCuda``. ``strict``: also run
    torch's own fake kernel of every CUDA op (its shape and device checks; several
    times slower)."""
    gpu = FakeCuda(strict=strict, **kw)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.multiple(torch.cuda, **gpu.patches()))
        stack.enter_context(mock.patch.object(torch, "Generator", _Generator))
        stack.enter_context(mock.patch.object(FakeTensor, "tolist", fake_tolist))
        stack.enter_context(torch.no_grad())  # autograd on a fake CUDA tensor aborts a CPU build
        stack.enter_context(gpu.mode)
        stack.enter_context(PythonBindings(gpu))
        gpu.graphs = stack.enter_context(fake_graphs(gpu))  # torch.cuda.CUDAGraph and graph (fake_graphs)
        yield gpu


@contextlib.contextmanager
def cuda_api(**kw):
    """``torch.cuda``'s functions patched, and nothing else (no fake tensors): for CPU code
    that calls them, as the memory profile of tensor-parallel ranks on gloo does in a test."""
    gpu = FakeCuda(**kw)
    with mock.patch.multiple(torch.cuda, **gpu.patches()):
        yield gpu
