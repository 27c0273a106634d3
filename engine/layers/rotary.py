"""Rotary position embeddings (the "rotate half" layout of Hugging Face Llama)."""

import torch
from torch import nn

from engine.layers import cpu_kernels


def rope_parameters(config) -> dict:
    """The config's rope settings, from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (transformers 4)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def inv_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2], attention_scaling)`` for the config's rope type."""
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        theta = float(params["rope_theta"])
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    return inv_freq.float(), float(scaling)


def table_device() -> torch.device:
    """Where a computed table goes: the default device (models are built under
    ``torch.device(...)``), but the CPU under ``meta``, whose tensors hold no values:
    a table is computed, never loaded, so it keeps its values until
    ``engine.loader.materialize`` moves it where the weights go."""
    device = torch.get_default_device()
    return torch.device("cpu") if device.type == "meta" else device


class RotaryEmbedding(nn.Module):
    """Applies rope to q and k at given positions, from a precomputed cos/sin table
    (computed in float32 on the CPU, where transformers gives the frequencies)."""

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        device = table_device()
        with torch.device("cpu"):  # whatever device the model is built under
            inv_freq, scaling = inv_frequencies(config, head_dim)
            t = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim // 2]
            emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", (emb.cos() * scaling).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, head_dim], computed once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (queries and keys side by side) -> rotated x."""
    if cpu_kernels.usable(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return cpu_kernels.rope(x, cos, sin)
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
