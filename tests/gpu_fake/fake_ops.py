"""The two modes behind ``tests.gpu_fake.fake_cuda``: what CUDA tensors are under the harness.

``FakeCudaMode`` (a ``FakeTensorMode``) makes every CUDA tensor a ``FakeTensor`` that
carries its values (a CPU tensor, ``value(t)``) and runs each op on those values;
CPU tensors stay real. Before an op runs it applies CUDA's device rule (one device
per op; CPU scalars mix; CPU index tensors may index a CUDA tensor) and counts what
would stall the host or copy over the bus. With ``strict`` it also runs torch's own
fake kernel of the op, for its checks and shapes.

``PythonBindings`` (a ``TorchFunctionMode``) stands in for the parts of torch's
Python bindings that a CPU build cannot run on a CUDA tensor: they resolve the
current CUDA device or open a CUDA device guard before dispatching.
"""

import torch
from torch._subclasses.fake_tensor import (
    _DISPATCH_HANDLE_DIRECTLY,
    _DISPATCH_META_HANDLERS,
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)
_VALUE = "_fake_cuda_value"  # the attribute of a fake that holds its CPU values
_DATA_ATTR = torch._C.TensorBase.__dict__["data"]

# What torch's fake kernels raise for ops whose output shapes need values (strict mode).
_NEED_VALUES = (DynamicOutputShapeException, DataDependentOutputException)
# Ops whose output shape depends on values: CUDA syncs the host to size the output.
_SYNCING = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default, aten.repeat_interleave.Tensor}
# Ops that take a CPU index tensor on a CUDA tensor (CUDA copies the index over).
_CPU_INDEX_OK = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
_RANDOM = {aten.exponential_.default, aten.uniform_.default, aten.normal_.default, aten.random_.default,
           aten.bernoulli_.float, aten.bernoulli.default, aten.multinomial.default,
           aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default}


class FakeCudaMode(FakeTensorMode):
    """The dispatch mode: fakes for CUDA, real tensors for everything else."""

    def __init__(self, gpu, strict: bool):
        """``gpu``: the harness's handle (``fake_cuda.FakeCuda``), which counts and tracks memory."""
        super().__init__(allow_non_fake_inputs=True)
        self.cache_enabled = False  # values ride on the outputs: every op must run
        self.gpu, self.strict = gpu, strict
        self._shims = {aten._to_copy.default: FakeCudaMode._to_copy, aten.copy_.default: FakeCudaMode._copy,
                       aten._pin_memory.default: lambda mode, t, *_: mode.gpu.pin(t.clone()),
                       aten.is_pinned.default: lambda mode, t, *_: mode.gpu.is_pinned(t)}

    @property
    def avoid_device_init(self) -> bool:  # a CPU build: never touch a real CUDA device
        return True

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _DISPATCH_META_HANDLERS or func in _DISPATCH_HANDLE_DIRECTLY:  # .device, sizes, strides
            return super().dispatch(func, types, args, kwargs)
        flat = _tensors(args, kwargs)
        fakes = [a for a in flat if isinstance(a, FakeTensor)]
        if func in self._shims:
            return self._shims[func](self, *args, **kwargs)
        if func.overloadpacket is aten.to:  # inference mode dispatches aten.to itself
            return self._to(func, args, kwargs)
        if fakes and (cuda_impl := _custom_op_cuda_impl(func)) is not None:
            return cuda_impl(*args, **kwargs)  # a library's own op (flash-attn's): its Python CUDA body
        if func is aten._local_scalar_dense.default and fakes:
            self.gpu.sync(".item() / bool() / float()")
            return value(args[0]).item()
        if not fakes and not _on_cuda(kwargs.get("device")):
            return self._real(func, args, kwargs)
        if func in _CPU_INDEX_OK:
            args = self._indices_to_cuda(args)
        else:
            _common_device(func, flat)
        if self.strict and func not in _RANDOM and kwargs.get("generator") is None:
            try:
                super().dispatch(func, types, args, kwargs)  # torch's own fake kernel: its checks, its shapes
            except _NEED_VALUES:
                pass
        if func in _SYNCING and not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size")):
            self.gpu.sync(f"data-dependent shape ({func.__name__})")
        return self._from_values(func, args, kwargs, fakes)

    def _real(self, func, args, kwargs):
        """An op on real (CPU or meta) tensors only: run it; record pinned allocations."""
        if not kwargs.get("pin_memory"):
            return func(*args, **kwargs)
        kwargs["pin_memory"] = False
        return self.gpu.pin(func(*args, **kwargs))

    def _from_values(self, func, args, kwargs, fakes):
        """Runs ``func`` on the values and wraps its tensor outputs on CUDA; an output that
        is an input's values (in-place and ``out=`` ops) comes back as that input."""
        out = func(*_values(args), **_values(kwargs))
        inputs = {id(value(f)): f for f in fakes}

        def fake_of(t):
            if not isinstance(t, torch.Tensor):
                return t
            return inputs[id(t)] if id(t) in inputs else self.wrap(t)

        return _map(fake_of, out)

    def wrap(self, real: torch.Tensor) -> FakeTensor:
        """A fake CUDA tensor with ``real``'s shape, strides, dtype and values."""
        with torch.inference_mode(False):  # never an inference tensor: views of it share its version counter
            meta = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="meta")
            fake = FakeTensor(self, meta, CUDA)
        set_value(fake, real)
        self.gpu.track(fake)
        return fake

    def _to_copy(self, x, *, device=None, non_blocking=False, pin_memory=None, **kw):
        src = x.device
        dst = torch.device(device) if device is not None else src
        if src.type != "cuda" and dst.type != "cuda":
            return self._real(aten._to_copy.default, (x,), dict(device=device, pin_memory=pin_memory, **kw))
        real = aten._to_copy.default(value(x), **kw)  # a new tensor, on the CPU
        if dst.type != "cuda":  # device to host: a real CPU tensor
            if not non_blocking:
                self.gpu.sync("device-to-host copy")
            return real
        if src.type != "cuda":
            self.gpu.h2d(x, non_blocking)
        return self.wrap(real)

    def _to(self, func, args, kwargs):
        """Any ``aten.to`` overload: ``x`` itself when nothing changes, else ``_to_copy``."""
        bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
        x, other = bound["self"], bound.get("other")
        device = bound.get("device") or (other.device if other is not None else x.device)
        dtype = bound.get("dtype") or (other.dtype if other is not None else x.dtype)
        if torch.device(device) == x.device and dtype == x.dtype and not bound.get("copy"):
            return x
        return self._to_copy(x, device=device, dtype=dtype, non_blocking=bound.get("non_blocking", False))

    def _copy(self, dst, src, non_blocking=False):
        if isinstance(dst, FakeTensor) and not isinstance(src, FakeTensor) and src.dim() > 0:
            self.gpu.h2d(src, non_blocking)
        elif not isinstance(dst, FakeTensor) and isinstance(src, FakeTensor):
            if not (non_blocking and self.gpu.is_pinned(dst)):
                self.gpu.sync("device-to-host copy")
        value(dst).copy_(value(src), non_blocking)
        return dst

    def _indices_to_cuda(self, args):
        """CUDA copies CPU index tensors over (a blocking host-to-device copy); a CPU
        tensor takes no CUDA index."""
        self_, indices, *rest = args
        if not isinstance(self_, FakeTensor):
            raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor (cpu)")
        moved = [self._to_copy(i, device=CUDA) if isinstance(i, torch.Tensor) and not isinstance(i, FakeTensor) else i
                 for i in indices]
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in moved):
            self.gpu.sync("data-dependent shape (boolean index)")
        return (self_, moved, *rest)


def value(t):
    """The values of a fake CUDA tensor (a CPU tensor); a real tensor is its own."""
    return getattr(t, _VALUE) if isinstance(t, FakeTensor) else t


def set_value(fake: FakeTensor, real: torch.Tensor) -> None:
    setattr(fake, _VALUE, real)


def _values(tree):
    def real(a):
        if isinstance(a, FakeTensor):
            return value(a)
        if isinstance(a, torch.device) and a.type == "cuda":
            return torch.device("cpu")
        return a

    return _map(real, tree)


def _map(fn, x):
    """``fn`` over the leaves of nested tuples, lists and dicts (pytree's map, faster)."""
    if isinstance(x, (tuple, list)):
        mapped = [_map(fn, y) for y in x]
        return mapped if isinstance(x, list) else tuple(mapped) if type(x) is tuple else type(x)(mapped)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _tensors(args, kwargs) -> list:
    """The tensors among an op's arguments (aten nests them one level at most: Tensor[])."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _custom_op_cuda_impl(func):
    """The Python CUDA implementation of a ``torch.library.custom_op`` (flash-attn registers
    its kernels so), or None; it runs on the fake tensors themselves."""
    if func.namespace in ("aten", "prims", "prim"):
        return None
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(func._schema.name)
    return None if opdef is None else opdef._backend_fns.get("cuda")


def _common_device(func, flat) -> None:
    """Raises when tensors of two devices meet, as CUDA kernels do (CPU scalars mix)."""
    common = None
    for a in flat:
        if not isinstance(a, torch.Tensor):
            continue
        device = CUDA if isinstance(a, FakeTensor) else a.device
        if device.type == "cpu" and a.dim() == 0:
            continue
        if common is None:
            common = device
        elif device != common:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, {common} and "
                f"{device}! ({func})")


def _on_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _check_generator(func, args, kwargs) -> None:
    """CUDA ops need a CUDA generator, CPU ops a CPU one (checked before dispatch, where
    the generator is still the object the caller made)."""
    g = kwargs["generator"]
    fakes = any(isinstance(a, FakeTensor) for a in _tensors(args, {}))
    want = "cuda" if fakes or _on_cuda(_with_index(kwargs.get("device"))) else "cpu"
    if g.device.type != want:
        raise RuntimeError(f"Expected a '{want}' device type for generator but found '{g.device.type}' ({func})")


class PythonBindings(TorchFunctionMode):
    """What happens before dispatch, in torch's Python bindings, done here instead.

    CUDA device arguments get their index (``"cuda"`` -> ``cuda:0``): a CPU build cannot
    look up the current CUDA device. And the methods whose bindings open a CUDA device
    guard, which a CPU build does not have (indexing, ``copy_``, ``contiguous``, scalar
    reads, ...), are rerouted to the ops they call."""

    def __init__(self, gpu):
        super().__init__()
        self.gpu = gpu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], FakeTensor) and func in _ON_FAKE:
            return _ON_FAKE[func](self.gpu, *args, **kwargs)
        if getattr(func, "__self__", None) is _DATA_ATTR and func.__name__ == "__set__":
            func(*args)  # tensor.data = new: the tensor takes new's storage, so its values too
            if isinstance(args[0], FakeTensor):
                self.gpu.retrack(args[0], value(args[1]))
            return None
        if func is torch.Tensor.pin_memory:  # a CPU build has no pinned memory: recorded, not done
            return self.gpu.pin(args[0].clone())
        if func is torch.nonzero and args and isinstance(args[0], FakeTensor):
            return _ON_FAKE[torch.Tensor.nonzero](self.gpu, *args, **kwargs)
        if kwargs.get("generator") is not None:
            _check_generator(func, args, kwargs)
        if any(isinstance(a, (str, torch.device)) for a in (*args, *kwargs.values())):
            args, kwargs = [_with_index(a) for a in args], {k: _with_index(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _with_index(a):
    if isinstance(a, torch.device) and a.type == "cuda" and a.index is None:
        return CUDA
    if isinstance(a, str) and (a == "cuda" or a.startswith("cuda:")):
        return torch.device(a) if ":" in a else CUDA
    return a


def _scalar(gpu, t, *_args):
    return aten._local_scalar_dense.default(t)


def fake_tolist(t: FakeTensor) -> list:
    """``FakeTensor.tolist`` under the harness: one device-to-host sync, not one per element."""
    t.fake_mode.gpu.sync(".tolist()")
    return value(t).tolist()


def _numpy(gpu, t, **_kw):
    raise TypeError(f"can't convert {t.device} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                    "to host memory first.")


def _contiguous(gpu, t, memory_format=torch.contiguous_format):
    return t if t.is_contiguous(memory_format=memory_format) else aten.clone.default(t, memory_format=memory_format)


def _one_hot(gpu, t, num_classes=-1):
    """CUDA's one_hot (torch takes another path for fake tensors, which mixes devices)."""
    n = num_classes if num_classes >= 0 else int(t.max()) + 1
    return torch.zeros(*t.shape, n, dtype=torch.long, device=t.device).scatter_(-1, t.unsqueeze(-1), 1)


def _nonzero(gpu, t, *, as_tuple=False):
    out = aten.nonzero.default(t)
    return out.unbind(1) if as_tuple else out


def _new_tensor(gpu, t, data, dtype=None, device=None, requires_grad=False):
    return torch.tensor(data, dtype=dtype or t.dtype, device=_with_index(device) or t.device)


def _basic_index(t, index):
    """Python indexing up to the advanced part: the view after ints, slices, None and
    Ellipsis, and the index tensors of ``aten.index`` (one entry per view dim, None
    where a dim is taken whole)."""
    index = index if isinstance(index, tuple) else (index,)
    consumed = sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
                   for i in index if i is not None and i is not Ellipsis)
    view, dim, entries = t, 0, []
    for item in index:
        if item is Ellipsis:
            k = t.dim() - consumed
            entries += [None] * k
            dim += k
        elif item is None:
            view = aten.unsqueeze.default(view, dim)
            entries.append(None)
            dim += 1
        elif isinstance(item, slice):
            view = aten.slice.Tensor(view, dim, item.start, item.stop, item.step or 1)
            entries.append(None)
            dim += 1
        elif isinstance(item, int) and not isinstance(item, bool):
            view = aten.select.int(view, dim, item)
        else:
            tensor = item if isinstance(item, torch.Tensor) else torch.tensor(item)
            entries.append(tensor)
            dim += tensor.dim() if tensor.dtype == torch.bool else 1
    while entries and entries[-1] is None:
        entries.pop()
    return view, entries


def _getitem(gpu, t, index):
    view, entries = _basic_index(t, index)
    return aten.index.Tensor(view, entries) if entries else view


def _setitem(gpu, t, index, v):
    view, entries = _basic_index(t, index)
    if not isinstance(v, torch.Tensor):
        v = torch.full((), v, dtype=t.dtype, device=t.device)
    if entries:
        aten.index_put_.default(view, entries, v)
    else:
        aten.copy_.default(view, v)


_ON_FAKE = {
    torch.Tensor.__getitem__: _getitem, torch.Tensor.__setitem__: _setitem,
    torch.Tensor.copy_: lambda gpu, t, src, non_blocking=False: aten.copy_.default(t, src, non_blocking),
    torch.nn.functional.one_hot: _one_hot, torch.Tensor.contiguous: _contiguous,
    torch.Tensor.__invert__: lambda gpu, t: aten.bitwise_not.default(t), torch.Tensor.nonzero: _nonzero,
    torch.Tensor.new_tensor: _new_tensor,
    torch.Tensor.item: _scalar, torch.Tensor.numpy: _numpy,
    torch.Tensor.__bool__: lambda gpu, t: bool(_scalar(gpu, t)), torch.Tensor.__float__: lambda gpu, t: float(_scalar(gpu, t)),
    torch.Tensor.__int__: lambda gpu, t: int(_scalar(gpu, t)), torch.Tensor.__index__: lambda gpu, t: int(_scalar(gpu, t)),
}


