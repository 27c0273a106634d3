"""Checking stand-ins for the GPU kernels under flash-attn 2.8.3's fused ops.

flash-attn's own Python files (``tests.gpu_fake.flash_attn_sdist``) launch their Triton
kernels through ``torch.library.wrap_triton(kernel)[grid](...)`` (``ops/triton/layer_norm.py``,
``ops/triton/rotary.py``) and their jiterator kernels through
``torch._C._cuda_jiterator_compile_and_launch_kernel`` (``ops/activations.py``). Under the
harness both land here (``patches``): each launch is one op, ``fake_cuda::launch``, so
``fake_graphs`` counts it as one kernel and a CUDA graph records and replays it, and it
computes what the kernel computes from the pointers, strides and flags it is given
(float32 inside, stored in each output's dtype). A kernel or a flag it does not model
raises, as does a launch on CPU tensors ("cannot be accessed from Triton").

Compilation: a kernel compiles (and an autotuned one benchmarks its configs, syncing) the
first time it meets a specialization: its constexprs, each int argument's being 1 or a
multiple of 16, each pointer's 16-byte alignment (the jiterator: its dtypes). A first
launch inside a CUDA graph capture raises ``GraphUnsafe``, as the capture would fail on a
GPU: every shape must have run eagerly first. ``reset()`` forgets what was compiled (a new
process), which ``real_flash_attn`` does on entry.
"""

import inspect
import json

import torch
from torch._subclasses.fake_tensor import FakeTensor

from tests.gpu_fake import fake_graphs
from tests.gpu_fake.fake_graphs import FakeGraph, GraphUnsafe
from tests.gpu_fake.fake_ops import FakeCudaMode

launches: list[str] = []  # kernel names, in launch order, for the tests
_compiled: set = set()  # the specializations compiled so far (``_compile``)


def reset() -> None:
    _compiled.clear()


@torch.library.custom_op("fake_cuda::launch", mutates_args=("tensors",))
def _launch(name: str, tensors: list[torch.Tensor], spec: str) -> None:
    """One kernel: ``spec`` (JSON) holds the non-tensor arguments and, for each tensor
    argument, its index in ``tensors``; runs on the CPU values."""
    args = json.loads(spec)
    for key, i in args.pop("_tensors").items():
        args[key] = tensors[i]
    KERNELS[name](args)


@_launch.register_fake
def _(name, tensors, spec) -> None:
    return None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _launch_op(name: str, args: dict) -> None:
    """Every tensor argument on the GPU (a Triton pointer, a jiterator operand); None stays None."""
    tensors = {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}
    for key, t in tensors.items():
        _check(isinstance(t, FakeTensor) or t.device.type != "cpu" or not _at_top(),
               f"Pointer argument ({key}) cannot be accessed from Triton (cpu tensor?)")
    spec = {k: v for k, v in args.items() if not isinstance(v, torch.Tensor)}
    spec["_tensors"] = {k: i for i, k in enumerate(tensors)}
    _compile(name, args)
    launches.append(name)
    torch.ops.fake_cuda.launch(name, list(tensors.values()), json.dumps(spec))


def _specialization(name: str, args: dict) -> tuple:
    """What the kernel is compiled for (see the module doc); the grid is not part of it."""
    def key(v):
        if isinstance(v, torch.Tensor):
            return (v.dtype, v.storage_offset() * v.element_size() % 16 == 0)  # allocations are 256-byte aligned
        if isinstance(v, int) and not isinstance(v, bool):
            return (v == 1, v % 16 == 0)
        return "float" if isinstance(v, float) else v

    return (name, *((k, key(v)) for k, v in args.items() if k != "_grid"))


def _compile(name: str, args: dict) -> None:
    specialization = _specialization(name, args)
    if specialization in _compiled:
        return
    if any(isinstance(getattr(listener, "__self__", None), FakeGraph) for listener in fake_graphs._listeners):
        raise GraphUnsafe(f"the captured region compiles {name} for a specialization not run before the capture "
                          "(Triton compiles and autotunes on first launch): run every shape eagerly first")
    _compiled.add(specialization)


def _at_top() -> bool:
    """Whether no fake-CUDA op is running (its mode is then active): inside one (a library op
    such as flash-attn's layer norm runs its body on the CPU values) a launch sees CPU tensors."""
    return isinstance(torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE), FakeCudaMode)


def _kernel_name(kernel) -> str:
    fn = kernel
    while hasattr(fn, "fn"):  # Autotuner -> JITFunction -> the Python function
        fn = fn.fn
    return fn.__name__


class _Launcher:
    """``wrap_triton(kernel)[grid]``: binds the launch's arguments to the kernel's parameters."""

    def __init__(self, kernel):
        self.name, self.kernel = _kernel_name(kernel), kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _check(self.name in KERNELS, f"the stand-in does not model the Triton kernel {self.name}")
            fn = self.kernel
            while hasattr(fn, "fn"):
                fn = fn.fn
            bound = inspect.signature(fn).bind(*args, **kwargs).arguments
            if callable(grid):  # grid(META) -> (..., batch): the rotary kernel's batch is its last axis
                bound["_grid"] = list(grid({k: v for k, v in bound.items() if k.isupper()}))
            _launch_op(self.name, dict(bound))

        return launch


def wrap_triton(kernel):
    """``torch.library.wrap_triton`` under the harness."""
    return _Launcher(kernel)


def jiterator_launch(code_string, kernel_name, return_by_ref, num_outputs, tensors, kwargs):
    """``torch._C._cuda_jiterator_compile_and_launch_kernel`` under the harness: an
    elementwise kernel over same-shaped operands, into a new tensor of the first one's dtype."""
    _check(kernel_name in KERNELS, f"the stand-in does not model the jiterator kernel {kernel_name}")
    _check(num_outputs == 1 and not kwargs, "the stand-in models one output and no extra arguments")
    x = tensors[0]
    _check(all(t.shape == x.shape and t.dtype == x.dtype for t in tensors), "jiterator operands must match")
    out = torch.empty_like(x)
    _launch_op(kernel_name, {f"in{i}": t for i, t in enumerate(tensors)} | {"out": out})
    return out


def _rows(t: torch.Tensor, m: int, n: int, stride: int) -> torch.Tensor:
    """[m, n] rows ``stride`` apart from ``t``'s first element (what the kernel addresses)."""
    return t.as_strided((m, n), (stride, 1), t.storage_offset())


def _layer_norm_fwd(a: dict) -> None:
    """``_layer_norm_fwd_1pass_kernel``: RMS norm of x (+ residual, stored as the new residual)."""
    for flag in ("HAS_DROPOUT", "HAS_ROWSCALE", "HAS_X1", "HAS_W1", "HAS_B1"):
        _check(not a[flag], f"the stand-in does not model {flag}")
    _check(a["IS_RMS_NORM"], "the stand-in models the RMS norm only")
    m, n = a["M"], a["N"]
    _check(n <= a["BLOCK_N"], f"BLOCK_N {a['BLOCK_N']} < N {n}: the row would be cut")
    x = _rows(a["X"], m, n, a["stride_x_row"]).float()
    if a["HAS_RESIDUAL"]:
        x = x + _rows(a["RESIDUAL"], m, n, a["stride_res_row"]).float()
    if a["STORE_RESIDUAL_OUT"]:
        _rows(a["RESIDUAL_OUT"], m, n, a["stride_res_out_row"]).copy_(x)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + a["eps"])  # [m]
    a["Rstd"].copy_(rstd)
    w = a["W"].float() + (1.0 if a["zero_centered_weight"] else 0.0)
    y = x * rstd[:, None] * w
    if a["HAS_BIAS"]:
        y = y + a["B"].float()
    _rows(a["Y"], m, n, a["stride_y_row"]).copy_(y)


def _rotary(a: dict) -> None:
    """``rotary_kernel``, GPT-NeoX halves: row r of batch b at position r + offset[b];
    positions past the table are left unrotated (the kernel reads cos 1, sin 0 there)."""
    _check(not a["IS_VARLEN"] and not a["INTERLEAVED"] and not a["CONJUGATE"],
           "the stand-in models the batched, non-interleaved rotary")
    batch, seqlen, heads, half = a["_grid"][2], a["seqlen"], a["nheads"], a["ROTARY_DIM"] // 2
    cos_t, sin_t = a["COS"].reshape(-1, half).float(), a["SIN"].reshape(-1, half).float()  # [seqlen_ro, half]
    _check(a["COS"].is_contiguous() and a["SIN"].is_contiguous(), "cos and sin are addressed as contiguous")
    offsets = a["SEQLEN_OFFSETS"]
    offsets = offsets.long() if a["IS_SEQLEN_OFFSETS_TENSOR"] else torch.full((batch,), offsets)
    pos = offsets[:, None] + torch.arange(seqlen)[None, :]  # [batch, seqlen]
    inside = (pos < a["seqlen_ro"])[..., None, None]
    pos = pos.clamp(max=a["seqlen_ro"] - 1)
    cos, sin = cos_t[pos][:, :, None], sin_t[pos][:, :, None]  # [batch, seqlen, 1, half]
    view = lambda t, s: t.as_strided((batch, seqlen, heads, 2 * half), s, t.storage_offset())  # noqa: E731
    x = view(a["X"], [a[f"stride_x_{k}"] for k in ("batch", "seqlen", "nheads", "headdim")]).float()
    x0, x1 = x[..., :half], x[..., half:]
    out = torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1)
    out = torch.where(inside, out, x)
    view(a["OUT"], [a[f"stride_out_{k}"] for k in ("batch", "seqlen", "nheads", "headdim")]).copy_(out)


def _swiglu_fwd(a: dict) -> None:
    """``swiglu_fwd``: silu(x) * y in float32, stored once."""
    x, y = a["in0"].float(), a["in1"].float()
    a["out"].copy_(x * y / (1.0 + torch.exp(-x)))


KERNELS = {"_layer_norm_fwd_1pass_kernel": _layer_norm_fwd, "rotary_kernel": _rotary, "swiglu_fwd": _swiglu_fwd}


def patches() -> dict:
    """(object, attribute) -> the stand-in, for ``mock.patch.object`` while flash-attn is in use."""
    return {(torch.library, "wrap_triton"): wrap_triton,
            (torch._C, "_cuda_jiterator_compile_and_launch_kernel"): jiterator_launch}
