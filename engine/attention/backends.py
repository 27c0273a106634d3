"""The attention backends, chosen once at start-up (``--attention-backend``).

Each backend builds its own metadata from the same plain per-request specs
(``SeqSpec``); the model calls ``paged_attention(q, k, v, kv_layer, meta)``, which
runs the forward of the backend that built ``meta``.

======================  =======================================================
``torch``               gather + SDPA with explicit masks, per query-length bucket
                        (``torch_backend``): the reference
``cpu``                 the torch backend with every short query (decodes, chains,
                        trees) attended by the AVX2 kernel straight from the cache
                        (``cpu_kernels.paged_attention``); float32 on the CPU
``torch_varlen``        flash-attn's layout and tree split with a torch kernel
                        (``varlen_backend.torch_kernel``): the CUDA fallback
``flash_attn``          flash-attn 2.x varlen over the paged cache
                        (``varlen_backend.flash_kernel``); KV blocks of 256 tokens;
                        steps of chains of one length through
                        ``flash_attn_with_kvcache`` (``varlen_backend.kvcache_attention``)
``auto``                flash_attn on CUDA in fp16/bf16 when flash-attn imports,
                        else torch_varlen on CUDA, cpu in float32 where the
                        kernels build, else torch
======================  =======================================================
"""

import importlib.util
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from engine.attention import torch_backend, varlen_backend
from engine.attention.metadata import AttentionMetadata, build_attention_metadata
from engine.attention.varlen_metadata import VarlenMetadata, build_varlen_metadata
from engine.layers import cpu_kernels

BACKEND_NAMES = ("auto", "torch", "cpu", "torch_varlen", "flash_attn")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    build_metadata: Callable  # (specs: list[SeqSpec], block_size, device) -> the backend's metadata
    block_size_multiple: int = 1  # the KV block size must be a multiple of this

    def block_size(self, requested: int) -> int:
        """``requested`` when the backend accepts it, else the smallest size it accepts."""
        return requested if requested % self.block_size_multiple == 0 else self.block_size_multiple


TORCH = AttentionBackend("torch", build_attention_metadata)
CPU = AttentionBackend("cpu", partial(build_attention_metadata, listed=True))
TORCH_VARLEN = AttentionBackend(
    "torch_varlen", partial(build_varlen_metadata, kernel=varlen_backend.torch_kernel, split_by_query_len=True)
)
FLASH_ATTN = AttentionBackend(
    "flash_attn", partial(build_varlen_metadata, kernel=varlen_backend.flash_kernel, kvcache=True),
    varlen_backend.FLASH_BLOCK_SIZE_MULTIPLE,
)
BACKENDS = {b.name: b for b in (TORCH, CPU, TORCH_VARLEN, FLASH_ATTN)}

_FORWARD = {AttentionMetadata: torch_backend.paged_attention, VarlenMetadata: varlen_backend.paged_attention}


def paged_attention(q, k, v, kv_layer, meta, *, window: int | None = None, scale: float | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q [T, H, D], k and v [T, KVH, D] -> [T, H, D], by the backend that built ``meta``. A layer
    with a sliding ``window`` sees the last ``window`` positions (``meta.for_window``); ``scale``
    is the softmax scale (default 1/sqrt(D)); ``softcap`` caps the scores by ``softcap * tanh(s / softcap)``."""
    return _FORWARD[type(meta)](q, k, v, kv_layer, meta.for_window(window), scale, softcap)


def flash_attn_status() -> str | None:
    """None when flash-attn imports with its compiled kernels; else why it cannot be used.
    Being installed is not enough: a wheel built for another torch or CUDA fails to load."""
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401 - loads flash_attn_2_cuda
    except Exception as e:  # noqa: BLE001 - ImportError, OSError (undefined symbol), ...: unusable either way
        return f"flash-attn is installed but does not load ({type(e).__name__}: {e})"
    return None


def flash_attn_installed() -> bool:
    return flash_attn_status() is None


def flash_head_dim_ok(head_dim: int | None) -> bool:
    """flash-attn's kernels take head dims that are multiples of 8, up to 256 (its interface
    pads others, the whole paged cache included, on every call)."""
    return head_dim is None or (head_dim % 8 == 0 and head_dim <= 256)


def select_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int | None = None,
                   kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """The backend for ``--attention-backend name`` over a KV cache of ``kv_dtype`` (default
    ``dtype``); ValueError when it cannot run here. torch and torch_varlen read any cache dtype
    (cast as they gather), cpu a float32 or bfloat16 one, flash_attn only the model's dtype."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {', '.join(BACKEND_NAMES)}; got {name!r}")
    kv_dtype = kv_dtype or dtype
    cuda, half = device.type == "cuda", dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        if cuda and half and kv_dtype == dtype and flash_head_dim_ok(head_dim) and flash_attn_installed():
            return FLASH_ATTN
        if cuda:
            return TORCH_VARLEN
        return CPU if dtype == torch.float32 and cpu_kernels.load() is not None else TORCH
    if name == "cpu" and (cuda or dtype != torch.float32 or cpu_kernels.load() is None):
        raise ValueError(f"attention backend cpu needs float32 on the CPU and the AVX2 kernels (device {device}, "
                         f"dtype {dtype}, kernels built: {cpu_kernels.load() is not None})")
    if name == "cpu" and kv_dtype not in cpu_kernels.KV_TYPES:
        raise ValueError(f"attention backend cpu reads a float32 or bfloat16 KV cache, not {kv_dtype}")
    if name == "flash_attn" and kv_dtype != dtype:
        raise ValueError(f"attention backend flash_attn reads a KV cache of the model's dtype ({dtype}), not "
                         f"{kv_dtype}: use --kv-cache-dtype auto, or --attention-backend torch_varlen")
    if name == "flash_attn" and not (cuda and half and flash_head_dim_ok(head_dim) and flash_attn_installed()):
        raise ValueError(
            "attention backend flash_attn needs a CUDA device, dtype float16 or bfloat16, a head dim that is a "
            f"multiple of 8 up to 256, and flash-attn (device {device}, dtype {dtype}, head dim {head_dim}, "
            f"flash-attn: {flash_attn_status() or 'loads'})"
        )
    return BACKENDS[name]
