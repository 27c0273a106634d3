"""Rotary position embeddings (the "rotate half" layout of Hugging Face Llama).

Each model holds a cos/sin table per rope kind (Gemma 3's local and global layers
differ), one row per position. The rope types whose frequencies Hugging Face
recomputes from the sequence length at every forward (``dynamic``, ``longrope``)
get, at row ``p``, the frequencies of a sequence of ``p + 1`` tokens: a token's
rotation depends on its own position only, never on the batch or on how its
prompt was chunked. It is what transformers computes when it decodes one token
at a time; a prompt prefilled past ``original_max_position_embeddings`` is
rotated by transformers with the long factors from its first position on, here
from that position on.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import cpu_kernels

DEFAULT_ROPE = "default"  # the rope kind of models with one rope for every layer


def rope_parameters(config, kind: str = DEFAULT_ROPE) -> dict:
    """The rope settings of ``kind``'s layers, from ``rope_parameters`` (transformers 5, per
    layer type where they differ) or ``rope_theta`` + ``rope_scaling`` (transformers 4)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if kind in params:
        params = dict(params[kind])
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    if params["rope_type"] == "su":  # Phi-3's first name for longrope
        params["rope_type"] = "longrope"
    return params


def rope_table(config, head_dim: int, max_positions: int, kind: str = DEFAULT_ROPE) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_positions, head_dim] float32 on the CPU, for ``kind``'s layers."""
    params = rope_parameters(config, kind)
    rope_type = params["rope_type"]
    positions = torch.arange(max_positions, dtype=torch.float32)
    if rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq, scaling = 1.0 / (float(params["rope_theta"]) ** exponent), 1.0
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
    elif rope_type == "longrope":
        freqs, scaling = _longrope_freqs(config, positions, kind)
    elif rope_type == "dynamic":
        freqs, scaling = _dynamic_freqs(config, positions, kind)
    else:  # linear, llama3, yarn, ...: frequencies fixed by the config
        inv_freq, scaling = _hf_frequencies(config, kind)
        freqs = torch.outer(positions, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
    return emb.cos() * scaling, emb.sin() * scaling


def _hf_frequencies(config, kind: str, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """transformers' own ``(inv_freq [head_dim // 2], attention_scaling)`` for the rope type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kw = {} if kind == DEFAULT_ROPE else {"layer_type": kind}
    if seq_len is not None:
        kw["seq_len"] = seq_len
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_parameters(config, kind)["rope_type"]](config, "cpu", **kw)
    return inv_freq.float(), float(scaling)


def _longrope_freqs(config, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, float]:
    """Short factors at positions below ``original_max_position_embeddings``, long ones from it on."""
    original = rope_parameters(config, kind).get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings")
    short, scaling = _hf_frequencies(config, kind)
    long, _ = _hf_frequencies(config, kind, seq_len=original + 1)
    inv_freq = torch.where((positions + 1 > original)[:, None], long, short)  # [P, head_dim // 2]
    return positions[:, None] * inv_freq, scaling


def _dynamic_freqs(config, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, float]:
    """NTK-aware frequencies of a sequence of p + 1 tokens at row p (the default ones up to
    ``max_position_embeddings``)."""
    inv_freq, scaling = _hf_frequencies(config, kind)
    freqs = torch.outer(positions, inv_freq)
    for p in range(config.max_position_embeddings, positions.shape[0]):  # past the trained length only
        freqs[p] = p * _hf_frequencies(config, kind, seq_len=p + 1)[0]
    return freqs, scaling


def table_device() -> torch.device:
    """Where a computed table goes: the default device (models are built under
    ``torch.device(...)``), but the CPU under ``meta``, whose tensors hold no values:
    a table is computed, never loaded, so it keeps its values until
    ``engine.worker.loader.materialize`` moves it where the weights go."""
    device = torch.get_default_device()
    return torch.device("cpu") if device.type == "meta" else device


class RotaryEmbedding(nn.Module):
    """Applies rope to q and k at given positions, from a precomputed cos/sin table
    (computed in float32 on the CPU, where transformers gives the frequencies)."""

    def __init__(self, config, head_dim: int, max_positions: int, kind: str = DEFAULT_ROPE):
        super().__init__()
        device = table_device()
        with torch.device("cpu"):  # whatever device the model is built under
            cos, sin = rope_table(config, head_dim, max_positions, kind)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)
        self._half_tables: dict = {}  # dtype -> (cos, sin) halves for flash-attn's kvcache call (``half_table``)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, head_dim], computed once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def halves(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, head_dim // 2] contiguous in the table's dtype: the
        table flash-attn's ``apply_rotary`` reads (row t for the step's token t; both halves repeat it)."""
        half = self.cos.shape[1] // 2
        return self.cos[:, :half][positions], self.sin[:, :half][positions]

    def half_table(self, dtype: torch.dtype, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [at least rows, head_dim // 2] contiguous in ``dtype``: the whole table
        as ``flash_attn_with_kvcache`` reads it (at least its cache's reach in rows; those past the
        table are zeros, never read). Made once per dtype (regrown for more rows), on the first
        step: before any CUDA graph capture, which runs every shape eagerly first."""
        cached = self._half_tables.get(dtype)
        if cached is None or cached[0].shape[0] < rows:
            half, pad = self.cos.shape[1] // 2, max(0, rows - self.cos.shape[0])
            cached = tuple(F.pad(t[:, :half], (0, 0, 0, pad)).to(dtype).contiguous() for t in (self.cos, self.sin))
            self._half_tables[dtype] = cached
        return cached


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (queries and keys side by side) -> rotated x."""
    if cpu_kernels.usable(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return cpu_kernels.rope(x, cos, sin)
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
