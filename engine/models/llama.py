"""Llama-family decoder (Llama, Mistral, Qwen2/3, SmolLM) over the paged KV cache.

The model sees one flat batch per step: ``num_tokens`` tokens from any number of
requests (prefill chunks, decodes, draft chains), each with its own position;
``AttentionMetadata`` says which tokens belong to which request and which KV
slots they read and write.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.layers import cpu_kernels, quant
from engine.layers.linear import (
    ColumnParallelLinear,
    PackedLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    calibrate_min_rows,
)
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.parallel import SINGLE, TPGroup



def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, tp: TPGroup):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, tp
        )
        q_part, kv_part, _ = self.qkv_proj.parts  # this rank's heads: (first row, rows)
        self.q_size, self.kv_size = q_part[1], kv_part[1]
        self.num_heads, self.num_kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, tp, q_part)
        self.qk_norm = getattr(config, "model_type", "") == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        if getattr(config, "attention_bias", False):
            raise NotImplementedError("attention biases (Qwen2) are not supported yet")

    def forward(self, rope, hidden, meta: AttentionMetadata, kv_cache):
        """hidden [T, hidden] -> [T, hidden]."""
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 * KVH) * D]
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
        qk = apply_rotary(qk, *rope)  # queries and keys rotated in one go
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = paged_attention(q, k, v, kv_cache.layer(self.layer_idx), meta)  # [T, H, D]
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config, tp: TPGroup):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported")
        part = tp.split(config.intermediate_size, "intermediate_size")  # this rank's (first unit, units)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, None, tp, parts=[part, part])
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp, part)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if cpu_kernels.usable(gate_up):
            return self.down_proj(cpu_kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, tp: TPGroup):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, meta, kv_cache):
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), meta, kv_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def fused_args(self) -> tuple | None:
        """This layer's ``cpu_kernels.layer_args`` (the whole layer in one C call), or None
        where it cannot run that way: no kernels, not float32 on the CPU, q/k norms, tensor
        parallel (its all-reduces sit between the kernels), or matrices some in GGUF blocks and
        some not. Call after ``prepack``."""
        attn, mlp = self.self_attn, self.mlp
        w = attn.qkv_proj.weight
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if (cpu_kernels.load() is None or w.dtype != torch.float32 or norms[0].weight.device.type != "cpu"
                or attn.qk_norm or attn.o_proj.tp.size > 1 or norms[0].eps != norms[1].eps):
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        matrices, matmul = tuple(m.kernel for m in linears), None
        if all(m.qweight is not None for m in linears):  # GGUF blocks: quant.linear's matmul
            matrices, matmul = tuple(m.qweight.handle for m in linears), quant.layer_matmul()
        if any(m is None for m in matrices):  # not laid out for the kernel (not float32 on the CPU)
            return None
        return cpu_kernels.layer_args(w.shape[1], attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                      mlp.down_proj.weight.shape[1], norms[0].eps, (norms[0].weight.data,
                                      norms[1].weight.data), matrices, matmul=matmul)


class LlamaForCausalLM(nn.Module):
    """``forward`` gives final hidden states; ``compute_logits`` the vocab logits.

    ``num_layers`` < config.num_hidden_layers builds only the first layers (the
    self-drafting early-exit model shares them with the full target).
    """

    def __init__(self, config, tp: TPGroup = SINGLE, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.min_rows = 1  # oneDNN matmul inputs of fewer rows are padded (set by prepack)
        self.fused: list[tuple] | None = None  # per layer, cpu_kernels.layer_args (set by prepack)
        max_positions = max_positions or config.max_position_embeddings
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if getattr(config, "tie_word_embeddings", False):
            self.embed_tokens.tie(self.lm_head)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_cache, num_layers=None, capture=()):
        """input_ids [T], positions [T] -> final-normed hidden states [T, hidden].

        ``capture`` (layer ids; EAGLE drafters): also return the hidden states entering
        each of those layers, id ``num_hidden_layers`` meaning the final-normed output,
        concatenated in that order: ``(hidden [T, hidden], features [T, len(capture) * hidden])``.
        """
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary(positions, hidden.dtype)
        fused = self._fused_inputs(hidden, rope, meta)  # kept alive through the loop
        step = cpu_kernels.step_args(*fused) if fused else None
        taken = {}
        for i, layer in enumerate(self.layers):  # (slicing a ModuleList builds a new one: ~0.15 ms a step)
            if i == num_layers:
                break
            if i in capture:
                taken[i] = hidden.clone() if step else hidden  # a fused layer writes in place
            if step:
                cpu_kernels.decoder_layer(hidden, self.fused[i], *kv_cache.layer(i), step)
            else:
                hidden = layer(rope, hidden, meta, kv_cache)
        hidden = self.norm(hidden)
        if not capture:
            return hidden
        taken[len(self.layers)] = hidden
        return hidden, torch.cat([taken[i] for i in capture], dim=-1)

    def prepack(self, quantize: tuple[str, str] | None = None) -> None:
        """Weights are final: let the linear layers lay them out for the C matmul (or, without
        it, for oneDNN, timing whether short inputs run faster padded: ``calibrate_min_rows``;
        or ``quantize`` them: GGUF types of the layers and of the head), and take the layers'
        addresses for whole-layer kernel calls (``fused``)."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.embed_tokens.tie(self.lm_head)
        linears = [m for m in self.modules() if isinstance(m, PackedLinear)]
        for module in linears:
            module.prepack(quantize and quantize[module is self.lm_head])
        self.embed_tokens.pack_quantized()
        self.min_rows = calibrate_min_rows(linears)
        fused = [layer.fused_args() for layer in self.layers]
        self.fused = fused if fused and all(fused) else None

    def _fused_inputs(self, hidden, rope, meta) -> tuple | None:
        """``cpu_kernels.step_args``' tensors when this step runs every layer in one C call
        each: every token attended through listed KV slots, float32 on the CPU outside
        autograd. Those calls make the same kernel calls as the layer modules, so the
        results are the same."""
        t = hidden.shape[0]
        if (self.fused is None or not isinstance(meta, AttentionMetadata) or not meta.lists_all(t)
                or not cpu_kernels.usable(hidden)):
            return None
        attn = self.layers[0].self_attn
        size = cpu_kernels.scratch_size(t, hidden.shape[1], attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                        self.layers[0].mlp.down_proj.weight.shape[1])
        cos, sin = (r.contiguous() for r in rope)
        return cos, sin, *meta.listed_args(), torch.empty(size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in float32."""
        return self.lm_head(hidden).float()

    # Hugging Face parameter name fragment -> (our module suffix, shard id).
    STACKED = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def load_weight(self, hf_name: str, tensor) -> bool:
        """Copy this rank's part of one Hugging Face checkpoint tensor into place; False
        if unused. ``tensor``: a tensor or a lazy safetensors slice (``loader``)."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name:
            return False
        if name == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False):
            return False
        shard_id = None
        for hf_part, (ours, sid) in self.STACKED.items():
            if hf_part in name:
                name, shard_id = name.replace(hf_part, ours), sid
                break
        module_name, _, param = name.rpartition(".")
        if param != "weight":
            raise ValueError(f"unexpected parameter {hf_name}")
        self.get_submodule(module_name).load(shard_id, tensor)  # copy_ converts the dtype
        return True
