"""Attention over the paged KV cache: per-step metadata and the backends."""

from engine.attention.metadata import (
    AttentionMetadata,
    SeqSpec,
    build_attention_metadata,
    tree_depths,
    tree_mask,
)
from engine.attention.torch_backend import paged_attention

__all__ = [
    "AttentionMetadata",
    "SeqSpec",
    "build_attention_metadata",
    "paged_attention",
    "tree_depths",
    "tree_mask",
]
