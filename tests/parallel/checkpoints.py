"""Helpers of the tensor-parallel tests: small checkpoints on disk (every rank
loads its shard from a path) and engines on them."""

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.worker.model_store import fetch_default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# Uneven on purpose: 3 KV heads (each with 2 query heads) split 2 + 1 over two ranks, as SmolLM2's.
TINY = dict(
    vocab_size=516, hidden_size=96, intermediate_size=128, num_hidden_layers=4, num_attention_heads=6,
    num_key_value_heads=3, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
    eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def save_random_llama(out: Path, seed: int = 0, std: dict | None = None, **overrides) -> Path:
    """A Hugging Face Llama checkpoint with seeded random weights: norms 1, embedding and
    head std 1 (logits of order ten, far from ties), other matrices std 1/sqrt(fan_in)
    unless ``std`` maps a name fragment to another std. It borrows the default model's
    tokenizer (only ids below its vocabulary size ever reach it)."""
    config = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            custom = next((s for part, s in (std or {}).items() if part in name), None)
            if "norm" in name:
                p.fill_(1.0)
            elif custom is not None:
                p.copy_(torch.randn(p.shape, generator=gen) * custom)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0.0, 1.0, generator=gen)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=gen)
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(fetch_default_model(), out)
    return out


def copy_tokenizer(src: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)


def save_first_layers(src: Path, out: Path, num_layers: int) -> Path:
    """A draft checkpoint: ``src``'s first ``num_layers`` layers, its embedding, norm, head and tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config))
    keep = {}
    for f in src.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for n in st.keys():
                if not n.startswith("model.layers.") or int(n.split(".")[2]) < num_layers:
                    keep[n] = st.get_tensor(n)
    save_file(keep, str(out / "model.safetensors"))
    copy_tokenizer(src, out)
    return out


def tp_engine(
    path: Path, tp: int, tokenizer=None, speculative=None, parallel=None, num_threads=None, **cache
) -> LLMEngine:
    """An engine on the checkpoint at ``path``, split ``tp`` ways (float32, CPU)."""
    config = EngineConfig(
        ModelConfig(
            model=str(path), dtype="float32", device="cpu", max_model_len=cache.pop("max_model_len", 256),
            num_threads=num_threads,
        ),
        CacheConfig(block_size=16, num_blocks=cache.pop("num_blocks", 256), **cache),
        SchedulerConfig(),
        speculative or SpeculativeConfig(),
        parallel or ParallelConfig(tensor_parallel_size=tp),
    )
    return LLMEngine(config, tokenizer=tokenizer)
