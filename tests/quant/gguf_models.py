"""Tiny GGUF checkpoints written with the ``gguf`` package's own writer, as llama.cpp's
converter lays them out: a seeded random Llama (transformers' class), its q and k rows
permuted into llama.cpp's rotary order, each weight matrix in a chosen block format, and a
byte-level BPE tokenizer of 260 tokens with SmolLM2's chat template."""

from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType, quants
from transformers import LlamaConfig, LlamaForCausalLM


def byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others are
    shifted past 255 (so every byte is one visible character)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    shifted = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}


K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = SPECIAL + list(byte_chars().values()) + ["th"]  # 260: ids 0-2 special, one per byte, one merge


def tiny_llama(hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, inter: int = 128, seed: int = 0):
    """transformers' Llama, seeded, weights of order one over sqrt(fan in) (logits far from ties)."""
    config = LlamaConfig(
        vocab_size=len(TOKENS), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 if "embed" in name or "lm_head" in name else p.shape[1] ** -0.5, generator=gen)
    return model.eval()


def blocks(weight: torch.Tensor, kind: str, seed: int = 0) -> np.ndarray:
    """weight [out, in] -> its blocks [out, row_bytes] in ``kind``: quantized by the gguf package
    where it can (Q8_0, Q4_0, Q4_1); for the K-quants, which it only reads, random codes under
    scales that give the weight's spread (the model then is whatever those blocks say)."""
    w = weight.detach().float().numpy()
    if kind not in K_QUANTS:
        return quants.quantize(w, GGMLQuantizationType[kind])
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    n = w.shape[0] * w.shape[1] // block
    data = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    spread = float(np.abs(w).mean())
    f16 = lambda v: np.full(n, v, np.float16).view(np.uint8).reshape(n, 2)  # noqa: E731
    if kind == "Q6_K":  # codes 0..63 around 32, int8 scales up to 127: d * 127 * 32 ~ 3 spreads
        data[:, 192:208] = rng.integers(1, 64, size=(n, 16), dtype=np.uint8)
        data[:, 208:210] = f16(spread / (32 * 32))
    else:  # 6-bit scales and mins up to 63: codes 0..15 (31), centred by dmin * m
        data[:, 0:2] = f16(spread / (4 * 32 if kind == "Q4_K" else 8 * 32))
        data[:, 2:4] = f16(spread / 32)
    return data.reshape(w.shape[0], -1)


def _llama_cpp_order(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows from Hugging Face's rotary order to llama.cpp's (its converter's ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def write_gguf(model, path: Path, kinds=lambda name: "Q4_1", head: str | None = "Q8_0", embed: str = "Q8_0") -> Path:
    """``model`` (transformers' Llama) to a GGUF file at ``path``: matrix ``name`` (e.g.
    ``blk.0.attn_v``) in block format ``kinds(name)`` ("F32" / "F16": plain), the output head in
    ``head`` (None: no head, tied to the embedding, as SmolLM2's), the embedding in ``embed``,
    the norms in F32."""
    cfg = model.config
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([TokenType.CONTROL] * len(SPECIAL) + [TokenType.NORMAL] * (len(TOKENS) - len(SPECIAL)))
    w.add_token_merges(["t h"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, tensor: torch.Tensor, kind: str) -> None:
        if kind in ("F32", "F16"):
            w.add_tensor(name, tensor.detach().numpy().astype(np.float32 if kind == "F32" else np.float16))
        else:
            w.add_tensor(name, blocks(tensor, kind, seed=len(name)), raw_dtype=GGMLQuantizationType[kind])

    sd = model.state_dict()
    add("token_embd.weight", sd["model.embed_tokens.weight"], embed)
    if head is not None:
        add("output.weight", sd["lm_head.weight"], head)
    add("output_norm.weight", sd["model.norm.weight"], "F32")
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[pre + "input_layernorm.weight"], "F32")
        add(f"blk.{i}.ffn_norm.weight", sd[pre + "post_attention_layernorm.weight"], "F32")
        for hf, name in GGUF_NAMES.items():
            t = sd[pre + ("mlp." if hf in ("gate_proj", "up_proj", "down_proj") else "self_attn.") + hf + ".weight"]
            if hf in ("q_proj", "k_proj"):
                t = _llama_cpp_order(t, cfg.num_attention_heads if hf == "q_proj" else cfg.num_key_value_heads)
            add(f"blk.{i}.{name}.weight", t, kinds(f"blk.{i}.{name}"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
