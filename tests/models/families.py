"""Tiny random checkpoints of every supported family, built with transformers' own config
and model classes (``save_pretrained``), each with its family's head layout and quirks:
grouped KV heads, biases, q/k norms, sliding windows shorter than the longest test
prompt, Gemma's offsets, scales and soft caps, fused Phi-3 tensors with longrope,
routed experts. They share the default model's tokenizer (its full vocabulary, so that
chat prompts encode), and each has a chat template and a generation config of its own
family's shape."""

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from engine.worker.model_store import fetch_default_model
from tests.parallel.checkpoints import copy_tokenizer, save_first_layers

WINDOW = 12  # sliding window of the windowed families: the long test prompt is longer
VOCAB = 49152  # the default model's tokenizer
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
              eos_token_id=2, pad_token_id=2)
HEAD_HALF = 8  # the rope factor lists' length for head_dim 16
# Phi-3's longrope switches to its long factors past this length: past the longest test prompt
# and its 32 generated tokens, because transformers' ``generate`` recomputes the whole cache with
# the long factors when a sequence crosses it, and we do not (docs/models.md);
# test_phi3_long_factors_match_transformers_decoding crosses it on its own checkpoint.
ORIGINAL_ROPE = 96


@dataclass(frozen=True)
class TinyFamily:
    name: str
    config: str  # transformers class names
    model: str
    overrides: dict = field(default_factory=dict)
    template: str = "chatml"  # key of TEMPLATES
    windowed: bool = False  # some layer has a sliding window shorter than the long prompt
    moe: bool = False
    # Tied embeddings (std 1 elsewhere) are small: each token's own embedding would dominate
    # its final hidden state, its own logit win, and greedy decoding repeat its input.
    embed_std: float = 1.0


FAMILIES = [
    TinyFamily("llama3", "LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32)), "llama3", embed_std=0.1),
    TinyFamily("mistral", "MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW), "mistral", windowed=True),
    TinyFamily("qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), embed_std=0.1),
    TinyFamily("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    TinyFamily("gemma2", "Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=3.0,
        final_logit_softcapping=8.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=False),
               "gemma", windowed=True),
    TinyFamily("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}),
               "gemma", windowed=True, embed_std=0.05),  # scaled by sqrt(hidden_size) = 8 in the model
    TinyFamily("phi3", "Phi3Config", "Phi3ForCausalLM", dict(
        sliding_window=WINDOW, original_max_position_embeddings=ORIGINAL_ROPE, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=ORIGINAL_ROPE,
            short_factor=[1.0 + 0.1 * i for i in range(HEAD_HALF)],
            long_factor=[2.0 + 0.5 * i for i in range(HEAD_HALF)])), "phi3", windowed=True),
    TinyFamily("mixtral", "MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2),
               "mistral", moe=True),
    TinyFamily("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=80,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1]), moe=True),
    TinyFamily("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, head_dim=32), moe=True),
    TinyFamily("olmoe", "OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2), moe=True),
]
BY_NAME = {f.name: f for f in FAMILIES}

TEMPLATES = {  # the families' chat formats, shortened
    "chatml": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "llama3": "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
              "{{ m.content }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    "mistral": "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
               "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}",
    "gemma": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}"
             "\n{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    "phi3": "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
}
GENERATION_EOS = [2, 0]  # generation_config.json's eos_token_id: a list, as Llama 3's


def randomize(model: torch.nn.Module, seed: int, embed_std: float = 1.0) -> None:
    """Seeded weights far from transformers' init, so that every quirk shows in the logits:
    norms (1 + w or w) off their init by N(0, 0.1), embedding and head ``embed_std`` (1:
    logits of order ten, far from ties), biases std 0.1, other matrices std 1/sqrt(fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.add_(0.1 * noise)
            elif "embed" in name or "lm_head" in name:
                p.copy_(embed_std * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)


def build_hf(family: TinyFamily, seed: int = 0):
    """The transformers model of ``family``, with seeded random weights, float32, eval mode."""
    config = getattr(transformers, family.config)(**{**COMMON, **family.overrides})
    model = getattr(transformers, family.model)(config)
    randomize(model, seed, family.embed_std)
    return model.eval()


def save_tiny(family: TinyFamily, out: Path, seed: int = 0) -> Path:
    """``family``'s checkpoint in ``out``: weights, config, the default tokenizer with the
    family's chat template, and a generation config (EOS ids and default sampling)."""
    model = build_hf(family, seed)
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(fetch_default_model(), out)
    (out / "chat_template.jinja").write_text(TEMPLATES[family.template])
    generation = {"eos_token_id": GENERATION_EOS, "bos_token_id": 1, "temperature": 0.6, "top_p": 0.9}
    (out / "generation_config.json").write_text(json.dumps(generation))
    return out


def save_draft(target: Path, out: Path, num_layers: int = 2) -> Path:
    """A draft checkpoint of the same family: the target's first ``num_layers`` layers."""
    save_first_layers(target, out, num_layers)
    config = json.loads((out / "config.json").read_text())
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][:num_layers]
        (out / "config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "generation_config.json"):
        shutil.copy(target / name, out / name)
    return out
