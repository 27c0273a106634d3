"""Small random-weight EAGLE heads for a target, as their published checkpoints."""

from pathlib import Path

import torch
from transformers import LlamaConfig

from drafters.eagle_head import EagleHead, save_eagle_head


def random_head(target, kind: str, seed: int = 0, draft_vocab: int | None = None, std: float = 1.0) -> EagleHead:
    """An ``eagle`` / ``eagle3`` head for ``target`` with seeded random weights; eagle3 with
    ``draft_vocab`` drafts over that many target tokens (a seeded random subset)."""
    cfg = target.config
    L = cfg.num_hidden_layers
    head_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False,
        draft_vocab_size=draft_vocab or cfg.vocab_size,
    )
    layers = (L,) if kind == "eagle" else (min(2, L - 1), L // 2, max(L - 3, 0))
    head = EagleHead(head_cfg, kind, target, 256, layers)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std * p.shape[1] ** -0.5)
        if draft_vocab:
            head.draft_to_target.copy_(torch.randperm(cfg.vocab_size, generator=gen)[:draft_vocab].sort().values)
    return head.eval()


def write_random_head(target, kind: str, path: Path, **kw) -> Path:
    save_eagle_head(random_head(target, kind, **kw), path)
    return path
