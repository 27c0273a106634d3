"""Small random-weight EAGLE heads for a target, as their published checkpoints; the small
target they draft for, and the engine and greedy run the EAGLE tests drive."""

from pathlib import Path

import torch
from transformers import LlamaConfig

from drafters.eagle_head import EagleHead, save_eagle_head
from engine.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.models.decoder import LlamaForCausalLM
from tests.engine_core.engine_helpers import greedy


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


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 3, 9, 3, 7], [4, 4, 4, 11, 2, 8, 1]]


def small_target(vocab_size: int = 16, layers: int = 6, seed: int = 0) -> LlamaForCausalLM:
    """A random Llama of a small vocabulary: a random head's drafts are then accepted now and then."""
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 1.0 if "embed" in name or "lm_head" in name else p.shape[-1] ** -0.5
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=gen) * std)
    return model.eval()


def eagle_engine(model, method=None, head=None, k: int = 3, **tree) -> LLMEngine:
    spec = SpeculativeConfig(method=method, model=str(head), num_speculative_tokens=k, adaptive=False, verify_cost=0.05,
                             **tree)
    config = EngineConfig(ModelConfig(max_model_len=128, dtype="float32", device="cpu"), CacheConfig(num_blocks=64),
                          speculative=spec if method else SpeculativeConfig())
    return LLMEngine(config, model=model, tokenizer=None)


def run(engine, prompts, max_tokens=30) -> list[list[int]]:
    reqs = [engine.add_request(f"r{i}", p, greedy(max_tokens)) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]
