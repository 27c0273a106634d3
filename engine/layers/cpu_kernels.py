"""The CPU kernels, float32, x86-64 with AVX2 + FMA (and AVX-512 where the CPU has it):
everything a step computes, at any number of tokens (docs/cpu.md).

``matmul`` multiplies by weights laid out once in panels (``kernel_weight``): each panel
one contiguous stream, every output one chain of FMAs over the input features in order,
so a row's result is the same bits at any batch size and a step's few rows read the
weights once (`python -m bench.kernels`). ``paged_attention`` attends every query straight
from the paged cache, the keys read once for the query vectors that share them, with one
fixed arithmetic per vector. ``rms_norm``, ``rope`` and ``silu_mul`` replace chains of
small torch ops (each handing off to the thread pool), ``moe`` runs a mixture of experts
(routing, experts, weighted sum) in one call, and ``decoder_layer`` a whole layer.
Together they make the engine batch invariant, bit for bit.

The C sources (``csrc/``: ``specserve_kernels.h`` declares what is called from here) are
compiled once per machine and flag set with the system's C compiler (``compile_library``,
which other kernel files can use for their own library) into
``$XDG_CACHE_HOME/specserve/kernels`` (``~/.cache`` by default) and loaded with ctypes,
which releases the GIL during the call. Without a compiler, AVX2 or FMA, or with
``SPECSERVE_CPU_KERNELS=0``, ``load()`` returns None and the torch ops do everything;
``SPECSERVE_CPU_AVX512=0`` keeps the AVX2 build on an AVX-512 CPU.
``SPECSERVE_CPU_SANITIZE=1`` builds every C library (``compile_library``) under
AddressSanitizer and UBSan, for tests (docs/testing.md): the process must preload libasan.
"""

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.utils.devices import cpu_flags

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
QUANT_SOURCE = "quant_kernels.c"  # in CSRC, a library of its own (engine/layers/quant.py)
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
AVX512 = ("-mavx512f",)  # added where the CPU has it, unless SPECSERVE_CPU_AVX512=0
AMD = ("-DAVX512_AMD",)  # AVX-512 on an AMD CPU: few rows' weights read 4 panels side by side, attention read ahead
SANITIZE = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined", "-g",
            "-O1")  # last -O wins: an instrumented -O3 build of quant_kernels.c compiles for minutes


def _cpu_supports() -> bool:
    flags = cpu_flags()
    return " avx2" in flags and " fma" in flags


def compile_flags() -> tuple[str, ...]:
    """The compiler flags for this CPU: AVX2 + FMA, and AVX-512 where there is one, which on an
    AMD CPU reads few rows' weights from several panels side by side and an attention item's
    keys ahead of its passes (on an Intel one, one panel at a time and no read ahead: docs/cpu.md).
    Chosen from the CPU's vendor, never from a timing: the choice never changes a bit."""
    info = cpu_flags()
    if " avx512f" in info and os.environ.get("SPECSERVE_CPU_AVX512", "1") != "0":
        return FLAGS + AVX512 + (AMD if "AuthenticAMD" in info else ())
    return FLAGS


def compiler() -> str | None:
    """The system's C compiler, or None."""
    return shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "specserve" / "kernels"


def _sanitized(flags: tuple[str, ...]) -> tuple[str, ...]:
    """With ``SPECSERVE_CPU_SANITIZE=1`` the flags gain ``SANITIZE``, so its builds have their own keys."""
    return (*flags, *SANITIZE) if os.environ.get("SPECSERVE_CPU_SANITIZE", "0") == "1" else flags


def library_path(name: str, sources: list[Path], compiler: str, flags: tuple[str, ...]) -> Path:
    """Where ``compile_library`` keeps the library: in the cache directory, keyed by a hash of
    the sources, the headers beside them, the compiler and the flags (``_sanitized``)."""
    flags = _sanitized(flags)
    digest = hashlib.sha256(" ".join((compiler, *flags)).encode())
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})
    for path in [*sources, *headers]:
        digest.update(path.name.encode() + path.read_bytes())
    return _cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"


def compile_library(name: str, sources: list[Path], compiler: str, flags: tuple[str, ...]) -> Path:
    """The shared library ``name`` built from C ``sources`` (with the headers beside them) by
    ``compiler`` with ``flags``, each source its own translation unit: compiled once
    (``library_path``); returns its path."""
    out, flags = library_path(name, sources, compiler, flags), _sanitized(flags)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # concurrent builders: atomic rename
        lib = Path(tmp) / out.name
        subprocess.run([compiler, *flags, *map(str, sources), "-o", str(lib)], check=True, capture_output=True,
                       timeout=300)
        lib.replace(out)
    return out


@functools.cache
def load():
    """The compiled library, or None where the kernels cannot be used."""
    if os.environ.get("SPECSERVE_CPU_KERNELS", "1") == "0" or not _cpu_supports():
        return None
    cc = compiler()
    if cc is None:
        log.info("no C compiler: the CPU kernels are off, torch ops do everything")
        return None
    try:
        return build(cc, compile_flags())
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not build the CPU kernels (%s): torch ops do everything", e)
        return None


def sources(csrc: Path = CSRC) -> list[Path]:
    """The C files of the kernels' library: every one in ``csrc`` but ``QUANT_SOURCE``."""
    return sorted(p for p in csrc.glob("*.c") if p.name != QUANT_SOURCE)


def build(compiler: str, flags: tuple[str, ...], csrc: Path = CSRC):
    """The library compiled with ``flags`` (cached on disk) from the sources in ``csrc`` (another
    checkout's, for a benchmark's baseline), its functions typed."""
    lib = ctypes.CDLL(str(compile_library("cpu_kernels", sources(csrc), compiler, flags)))
    lib.matmul_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.weight_panel.argtypes = ()
    lib.weight_panel.restype = ctypes.c_int
    lib.rms_norm_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
    for f in (lib.paged_attention_f32, lib.paged_attention_kv_bf16):
        f.argtypes = (
            [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int]
        )
    lib.silu_mul_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.argmax_rows_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.rope_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.decoder_layer_f32.argtypes = [ctypes.POINTER(LayerArgs), ctypes.POINTER(StepArgs), ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.moe_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    for f in (lib.matmul_f32, lib.rms_norm_f32, lib.silu_mul_f32, lib.rope_f32, lib.argmax_rows_f32):
        f.restype = None
    for f in (lib.paged_attention_f32, lib.paged_attention_kv_bf16, lib.decoder_layer_f32, lib.moe_f32):
        f.restype = ctypes.c_int  # 0, or a negative code (check)
    return lib


class KernelError(RuntimeError):
    """A C kernel returned an error code: its output is unwritten, so the step must fail."""


NO_MEMORY = -2  # csrc/specserve_kernels.h KERNEL_NO_MEMORY


def check(rc: int, kernel: str) -> None:
    """Raises ``KernelError`` for a kernel's nonzero return code ``rc``."""
    if rc:
        why = "out of memory" if rc == NO_MEMORY else "no kernel for a weight format" if rc == -1 else f"code {rc}"
        raise KernelError(f"the C kernel {kernel} failed: {why}")


KV_TYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' cache element types (specserve_kernels.h KV_F32, KV_BF16)


def kv_type(cache: torch.Tensor) -> int:
    """The kernels' code of a KV cache's dtype: float32, or bfloat16 (rounded to nearest even at
    the write, widened exactly to float32 at the read); ValueError for any other."""
    if cache.dtype not in KV_TYPES:
        raise ValueError(f"the CPU kernels read a float32 or bfloat16 KV cache, not {cache.dtype}")
    return KV_TYPES[cache.dtype]


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels can take ``x``: float32 on the CPU, outside autograd, kernels built."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled() and load() is not None


@dataclass(frozen=True, eq=False)  # compared by identity: never tensor by tensor
class KernelWeight:
    """A weight [out_features, in_features] laid out as the matmul reads it (``kernel_weight``):
    panels of ``weight_panel()`` output features, [ceil(out / panel), in, panel] zero padded,
    each panel one contiguous stream (csrc/matmul.c)."""

    data: torch.Tensor
    out_features: int
    in_features: int


def kernel_weight(weight: torch.Tensor, lib=None) -> KernelWeight:
    """weight [out, in] (float32, CPU) copied into the panels of the matmul of ``lib`` (default
    ``load()``, which must not be None then)."""
    n, k = weight.shape
    panel = (lib or load()).weight_panel()
    panels = -(-n // panel)
    padded = weight.new_zeros(panels * panel, k)
    padded[:n] = weight
    return KernelWeight(padded.view(panels, panel, k).transpose(1, 2).contiguous(), n, k)


def matmul(x: torch.Tensor, weight: KernelWeight) -> torch.Tensor:
    """x [M, in] -> x @ weight.T [M, out] (float32 on the CPU; ``load()`` must not be None).
    Each output is one chain of FMAs over ``in`` in order: a row's result is the same bits
    whatever the other rows are, at any M."""
    x = x.contiguous()
    m, n, k = x.shape[0], weight.out_features, weight.in_features
    assert x.shape[1] == k
    y = torch.empty(m, n, dtype=torch.float32)
    load().matmul_f32(x.data_ptr(), weight.data.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` per row of x [T, H], float32 on the CPU;
    ``load()`` must not be None."""
    x = x.contiguous()
    y = torch.empty_like(x)
    load().rms_norm_f32(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps,
                        torch.get_num_threads())
    return y


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                    start: torch.Tensor, length: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                    scale: float | None = None) -> None:
    """Writes ``out[rows[i]]`` [H, D] = attention of ``q[rows[i]]`` [H, D] over the keys and values at
    ``slots[start[i] : start[i] + length[i]]`` of ``k_cache``/``v_cache`` [num_slots, KVH, D].

    q [T, H, D] with unit strides within a row (a view into the fused qkv is fine); out [T, H, D]
    contiguous; rows, start, length [n] and slots int64. Softmax scale ``scale``, default 1/sqrt(D).
    The caches are float32 or bfloat16 (``kv_type``): the same arithmetic on the keys read as float32."""
    _, h, d = q.shape
    kvh = k_cache.shape[1]
    assert q.stride(2) == 1 and q.stride(1) == d and out.is_contiguous() and h % kvh == 0
    assert v_cache.dtype == k_cache.dtype
    lib = load()
    kernel = lib.paged_attention_kv_bf16 if kv_type(k_cache) else lib.paged_attention_f32
    rc = kernel(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), rows.data_ptr(), start.data_ptr(),
        length.data_ptr(), slots.data_ptr(), out.data_ptr(), rows.shape[0], h, kvh, d, scale or d**-0.5,
        torch.get_num_threads(),
    )
    check(rc, "paged_attention")


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's first maximum (its first NaN, where it has one), as
    ``logits.max(-1).indices.tolist()`` gives it: logits [T, N]; through the kernel where it is
    float32 on the CPU (``usable``), else torch's."""
    if not usable(logits) or logits.dim() != 2:
        return logits.max(-1).indices.tolist()
    x = logits.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    load().argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out.tolist()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    gate_up = gate_up.contiguous()
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=torch.float32)
    load().silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, torch.get_num_threads())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (unit strides within a row) -> rotated copy [T, heads, D]; cos, sin [T, 1, D]."""
    t, nh, d = x.shape
    assert x.stride(2) == 1 and x.stride(1) == d
    cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty(t, nh, d, dtype=torch.float32)
    load().rope_f32(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), t, nh, d)
    return y


class MoEArgs(ctypes.Structure):
    """A mixture of experts as ``moe`` and ``decoder_layer`` take it (csrc/specserve_kernels.h ``moe_t``):
    built by ``moe_args``, which keeps what it points to alive."""

    _fields_ = [("experts", ctypes.c_int64), ("top_k", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("normalize", ctypes.c_int64), ("shared_inter", ctypes.c_int64), ("router", ctypes.c_void_p),
                ("gate_up", ctypes.POINTER(ctypes.c_void_p)), ("down", ctypes.POINTER(ctypes.c_void_p)),
                ("shared_gate", ctypes.c_void_p), ("shared_gate_up", ctypes.c_void_p), ("shared_down", ctypes.c_void_p)]


def moe_args(router: KernelWeight, experts: list[tuple[KernelWeight, KernelWeight]], top_k: int, normalize: bool,
             shared: tuple[KernelWeight, KernelWeight, KernelWeight] | None = None) -> MoEArgs:
    """The ``MoEArgs`` of a router [E, hidden], E experts' (gate+up [2I, hidden], down
    [hidden, I]) and, where there is one, a shared expert's (gate [1, hidden], gate+up
    [2S, hidden], down [hidden, S]), all laid out by ``kernel_weight`` and never moved after."""
    pointers = lambda ms: (ctypes.c_void_p * len(ms))(*(m.data.data_ptr() for m in ms))  # noqa: E731
    args = MoEArgs(len(experts), top_k, experts[0][1].in_features, int(normalize),
                   shared[2].in_features if shared else 0, router.data.data_ptr(),
                   pointers([gu for gu, _ in experts]), pointers([d for _, d in experts]),
                   *(m.data.data_ptr() for m in shared or ()))
    args.weights = (router, experts, shared)  # the tensors the addresses point into
    return args


def moe(x: torch.Tensor, args: MoEArgs) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden]: the mixture of experts of ``args`` (``moe_args``): each
    token's top_k experts weighted and summed in rank order (csrc/moe.c); a token's result
    is the same bits whatever the other tokens are."""
    x = x.contiguous()
    out = torch.empty_like(x)
    rc = load().moe_f32(ctypes.addressof(args), x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                        torch.get_num_threads())
    check(rc, "moe")
    return out


class LayerArgs(ctypes.Structure):
    """A decoder layer's constants as ``decoder_layer`` takes them (csrc/specserve_kernels.h
    ``layer_t``, field for field): built by ``layer_args``, which keeps what it points to alive."""

    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p),
                ("w_qkv", ctypes.c_void_p), ("w_o", ctypes.c_void_p), ("w_gu", ctypes.c_void_p),
                ("w_down", ctypes.c_void_p), ("b_qkv", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("mm", ctypes.c_void_p), ("moe", ctypes.c_void_p)]


def layer_args(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float,
               norms: tuple[torch.Tensor, torch.Tensor], matrices: tuple[KernelWeight | None, ...],
               qkv_bias: torch.Tensor | None = None, qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
               matmul: int | None = None, moe: MoEArgs | None = None) -> LayerArgs:
    """A decoder layer's constant arguments of ``decoder_layer``: its sizes, and the addresses
    of its input and post-attention norms' weights (float32, contiguous), of its qkv, o,
    gate+up and down matrices (``kernel_weight``; or, with ``matmul``, the address of a C
    function of csrc/specserve_kernels.h's ``layer_matmul_fn``, the handles it reads, as ints),
    and of its qkv bias and per-head q and k norm weights where it has them, none of them ever
    moved afterwards. With ``moe`` (``moe_args``) the mixture of experts replaces the gated
    MLP: gate+up and down are then None, ``inter`` 0."""
    extra = (qkv_bias,) + (qk_norms or (None, None))
    assert all(w.dtype == torch.float32 and w.is_contiguous() for w in (*norms, *(t for t in extra if t is not None)))
    ln1, ln2 = (w.data_ptr() for w in norms)
    qkv, o, gate_up, down = (m if m is None or isinstance(m, int) else m.data.data_ptr() for m in matrices)
    b_qkv, q_norm, k_norm = (None if t is None else t.data_ptr() for t in extra)
    args = LayerArgs(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, inter=inter, eps=eps,
                     scale=head_dim**-0.5, ln1=ln1, ln2=ln2, w_qkv=qkv, w_o=o, w_gu=gate_up, w_down=down,
                     b_qkv=b_qkv, q_norm=q_norm, k_norm=k_norm, mm=matmul,
                     moe=None if moe is None else ctypes.addressof(moe))
    args.kept = (norms, matrices, extra, moe)  # what the addresses point into
    return args


class StepArgs(ctypes.Structure):
    """A step's arguments of ``decoder_layer`` (csrc/specserve_kernels.h ``step_t``, field for
    field): built by ``step_args``."""

    _fields_ = [("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("slot_mapping", ctypes.c_void_p),
                ("rows", ctypes.c_void_p), ("start", ctypes.c_void_p), ("len", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("scratch", ctypes.c_void_p)]


def step_args(cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor,
              start: torch.Tensor, length: torch.Tensor, slots: torch.Tensor, scratch: torch.Tensor) -> StepArgs:
    """A step's arguments of ``decoder_layer``, the same for every layer: cos, sin [T, 1, D]
    contiguous, the listed attention metadata (``ListedQueries``) of every token, and a
    float32 scratch of ``scratch_size`` floats. The tensors must outlive the step."""
    return StepArgs(*(t.data_ptr() for t in (cos, sin, slot_mapping, rows, start, length, slots, scratch)))


def scratch_size(tokens: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> int:
    return tokens * (2 * hidden + (2 * heads + 3 * kv_heads) * head_dim + heads * head_dim + 3 * inter)


def decoder_layer(x: torch.Tensor, layer: LayerArgs, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepArgs,
                  attn_in: torch.Tensor | None = None) -> None:
    """One decoder layer in place on x [T, hidden] (contiguous) for a step whose tokens
    all attend through listed slots: the same kernels, in the same order, as the model's
    own forward, in one call (csrc/layer.c, ``decoder_layer_f32``). ``layer`` from
    ``layer_args``, ``step`` from ``step_args``; k_cache, v_cache [blocks, block_size, KVH, D].
    ``attn_in`` [T, In] (contiguous): the attention's whole input in place of the input
    norm of x (an EAGLE head's layer; ``layer``'s qkv weight is then [.., In]). The caches are
    float32 or bfloat16 (``kv_type``: the new keys and values rounded to nearest even)."""
    ptr, width = (None, 0) if attn_in is None else (attn_in.data_ptr(), attn_in.shape[1])
    assert v_cache.dtype == k_cache.dtype
    rc = load().decoder_layer_f32(layer, step, x.data_ptr(), ptr, width, x.shape[0], k_cache.data_ptr(),
                                  v_cache.data_ptr(), kv_type(k_cache), torch.get_num_threads())
    check(rc, "decoder_layer")
