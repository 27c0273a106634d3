"""Attention over the paged KV cache: per-step metadata and the backends."""

from engine.attention.backends import AttentionBackend, paged_attention, select_backend
from engine.attention.metadata import (
    AttentionMetadata,
    SeqSpec,
    build_attention_metadata,
    tree_mask,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "SeqSpec",
    "build_attention_metadata",
    "paged_attention",
    "select_backend",
    "tree_mask",
]
