"""Engines on fake CUDA for the harness's tests: a tiny random Llama in bf16 on the
fake GPU, the engine around it, and a greedy/sampled run. Call inside ``fake_cuda()``."""

import torch
from transformers import LlamaConfig

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.models.decoder import LlamaForCausalLM

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)
PROMPTS = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [12]]  # repetitive: prompt lookup drafts and some drafts pass


def cuda_model(dtype=torch.bfloat16, seed: int = 0, echo: bool = False, **overrides) -> LlamaForCausalLM:
    """Seeded random weights (norms 1, embedding and head std 1: logits far from ties),
    made on the CPU and moved to the fake GPU. ``echo``: the head is the embedding and the
    layers only nudge the residual stream, so the likeliest next token is the last one:
    decoding repeats it, and prompt lookup drafts both rejected and accepted tokens."""
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        std = 1.0 if ("embed" in name or "lm_head" in name) else p.shape[-1] ** -0.5
        if echo and ("o_proj" in name or "down_proj" in name):
            std *= 0.02
        p.data = torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=gen) * std
    if echo:
        model.lm_head.weight.data = model.embed_tokens.weight.data.clone()
    return model.to(device="cuda", dtype=dtype).eval()


def cuda_engine(model, speculative: SpeculativeConfig | None = None, backend: str = "torch_varlen",
                num_blocks: int = 64, enforce_eager: bool = False, **scheduler) -> LLMEngine:
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    config = EngineConfig(
        ModelConfig(device="cuda", dtype=dtype, max_model_len=256, attention_backend=backend, enforce_eager=enforce_eager),
        CacheConfig(num_blocks=num_blocks), SchedulerConfig(max_num_batched_tokens=128, **scheduler),
        speculative or SpeculativeConfig(),
    )
    return LLMEngine(config, model=model)


def run(engine: LLMEngine, params_list, prompts=PROMPTS) -> tuple[list, int]:
    """Runs one request per (prompt, params) to its end; returns the requests and the number
    of draft tokens verified. Errors fail loudly."""
    drafted = []
    engine.stat_loggers.append(lambda stats: drafted.append(stats.spec.num_draft_tokens if stats.spec else 0))
    reqs = [engine.add_request(f"r{i}", p, params) for i, (p, params) in enumerate(zip(prompts, params_list))]
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
    return reqs, sum(drafted)
