"""Bigram language models that plug into the real engine path.

The next-token distribution depends only on the previous token, so the exact
probability of any continuation is a product of table entries.
"""

import torch
from torch import nn
from transformers import LlamaConfig


def bigram_table(vocab: int, seed: int) -> torch.Tensor:
    """A random row-stochastic [vocab, vocab] table P[prev, next], a function of
    ``seed`` alone: each row is Dirichlet(1, ..., 1), drawn as normalized Exp(1)
    variables from a generator of its own (never the global one, which other
    tests and every engine reseed)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.empty(vocab, vocab, dtype=torch.float64).exponential_(generator=g)
    return (t / t.sum(1, keepdim=True)).float()


def perturbed(table: torch.Tensor, seed: int, noise: float = 0.6) -> torch.Tensor:
    """A draft's table: the target's rows mixed with random rows."""
    other = bigram_table(table.shape[0], seed)
    mixed = (1 - noise) * table + noise * other
    return mixed / mixed.sum(1, keepdim=True)


class BigramLM(nn.Module):
    """Same interface as engine.models.decoder.LlamaForCausalLM; ignores the KV cache."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        vocab = table.shape[0]
        self.config = LlamaConfig(
            vocab_size=vocab, hidden_size=vocab, num_hidden_layers=1, num_attention_heads=1,
            num_key_value_heads=1, head_dim=1, intermediate_size=1, max_position_embeddings=64,
        )
        self.register_buffer("log_table", table.double().log().float())

    def forward(self, input_ids, positions, meta, kv_cache, num_layers=None):
        return nn.functional.one_hot(input_ids, self.config.vocab_size).float()  # [T, vocab]

    def compute_logits(self, hidden):
        return hidden @ self.log_table  # row of the previous token = log P[prev, :]
