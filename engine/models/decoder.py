"""The shared decoder of every family (``engine.models.registry``) over the paged KV cache.

Llama's layout (pre-norm attention with rope and grouped KV heads, a gated MLP)
with what the other families change, read from their ``Arch``: biases, q/k norms,
sliding windows and rope per layer, Gemma's norms, scales and soft caps, and
mixture-of-experts MLPs (``engine.models.moe``).

The model sees one flat batch per step: ``num_tokens`` tokens from any number of
requests (prefill chunks, decodes, draft chains), each with its own position;
``AttentionMetadata`` says which tokens belong to which request and which KV
slots they read and write.
"""

import torch
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.attention.varlen_backend import flash_kernel, kvcache_attention
from engine.attention.varlen_metadata import KVCacheStep, VarlenMetadata
from engine.layers import flash_ops
from engine.layers.cpu_decoder import FusedLayers
from engine.layers.linear import (
    ColumnParallelLinear,
    PackedLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    calibrate_min_rows,
)
from engine.layers.mlp import LlamaMLP
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models.arch import Arch, head_dim_of, llama_arch
from engine.models.moe import SparseMoE
from engine.layers.parallel import SINGLE, TPGroup

__all__ = ["LlamaForCausalLM", "head_dim_of"]


class LlamaAttention(nn.Module):
    def __init__(self, arch: Arch, layer_idx: int, tp: TPGroup):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = arch.head_dim
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, self.head_dim, arch.num_heads, arch.num_kv_heads, tp,
                                          bias=arch.qkv_bias)
        q_part, kv_part, _ = self.qkv_proj.parts  # this rank's heads: (first row, rows)
        self.q_size, self.kv_size = q_part[1], kv_part[1]
        self.num_heads, self.num_kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        self.o_proj = RowParallelLinear(arch.num_heads * self.head_dim, arch.hidden_size, tp, q_part, bias=arch.o_bias)
        self.qk_norm = arch.qk_norm
        if self.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, arch.eps, arch.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, arch.eps, arch.norm_offset)
        elif self.qk_norm == "full":
            self.q_norm = ShardedRMSNorm(q_part, arch.num_heads * self.head_dim, arch.eps, tp)
            self.k_norm = ShardedRMSNorm(kv_part, arch.num_kv_heads * self.head_dim, arch.eps, tp)
        self.window, self.scale, self.softcap = arch.windows[layer_idx], arch.attn_scale, arch.attn_softcap
        self.rope_kind = arch.rope_kinds[layer_idx]

    def forward(self, ropes: dict, hidden, meta: AttentionMetadata, kv_cache, ops: flash_ops.FlashOps | None = None):
        """hidden [T, hidden] -> [T, hidden]; ``ropes``: rope kind -> the step's rope
        (``LlamaForCausalLM.ropes``); ``ops``: flash-attn's fused kernels (``fused_ops``) or None."""
        qk, v = self._qkv(hidden)  # [T, H + KVH, D], [T, KVH, D]
        kv_layer, rope = kv_cache.layer(self.layer_idx), ropes[self.rope_kind]
        step = kvcache_step(meta, ops, self.head_dim)
        if step is not None:  # rope, the KV write and attention in one call
            out = kvcache_attention(qk[:, : self.num_heads], qk[:, self.num_heads :], v, kv_layer, step, *rope,
                                    window=self.window, scale=self.scale, softcap=self.softcap)
        else:
            if ops is None:
                qk = apply_rotary(qk, *rope)  # queries and keys rotated in one go
            else:  # one kernel; the step's tokens as one sequence whose row t is token t's rope
                qk = ops.apply_rotary(qk.unsqueeze(0), *rope)[0]
            out = paged_attention(qk[:, : self.num_heads], qk[:, self.num_heads :], v, kv_layer, meta,
                                  window=self.window, scale=self.scale, softcap=self.softcap)  # [T, H, D]
        return self.o_proj(out.reshape(-1, self.q_size))

    def _qkv(self, hidden):
        """hidden [T, hidden] -> (queries and keys [T, H + KVH, D] normed where the family norms
        them, not yet rotated; values [T, KVH, D])."""
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 * KVH) * D]
        qk = qkv[:, : self.q_size + self.kv_size]
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "full":  # over all of this token's query (key) features at once
            qk = torch.cat([self.q_norm(qk[:, : self.q_size]), self.k_norm(qk[:, self.q_size :])], dim=1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            qk = torch.cat([self.q_norm.heads(qk[:, : self.num_heads]), self.k_norm.heads(qk[:, self.num_heads :])], 1)
        return qk, v


class ShardedRMSNorm(nn.Module):
    """RMS norm over features split across ranks (OLMoE's q and k norms span every head):
    the sum of squares is all-reduced. ``part``: this rank's ``(start, size)`` of ``full``."""

    def __init__(self, part: tuple[int, int], full: int, eps: float, tp: TPGroup):
        super().__init__()
        self.start, self.full, self.eps, self.tp = part[0], full, eps, tp
        self.weight = nn.Parameter(torch.ones(part[1]), requires_grad=False)

    def load(self, shard_id, full, param: str = "weight") -> None:
        self.weight.data.copy_(full[self.start : self.start + self.weight.shape[0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, part] -> x / rms over the full features * weight, in x's dtype."""
        squares = self.tp.all_reduce(x.float().pow(2).sum(-1, keepdim=True))  # [T, 1]
        return self.weight * (x.float() * torch.rsqrt(squares / self.full + self.eps)).to(x.dtype)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP; with ``sandwich_norms`` (Gemma 2/3) their outputs are
    normed too: ``post_attention_layernorm`` then norms the attention's output and
    ``pre_feedforward_layernorm`` the MLP's input (Hugging Face's names)."""

    def __init__(self, arch: Arch, layer_idx: int, tp: TPGroup):
        super().__init__()
        self.self_attn = LlamaAttention(arch, layer_idx, tp)
        if arch.moe_layers[layer_idx]:
            self.mlp = SparseMoE(arch, tp)
        else:
            self.mlp = LlamaMLP(arch.hidden_size, arch.intermediate_size, tp, arch.activation, arch.mlp_bias)
        norm = lambda: RMSNorm(arch.hidden_size, arch.eps, arch.norm_offset)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.sandwich = arch.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, ropes, hidden, meta, kv_cache):
        ops = fused_ops(meta)
        if ops is not None and not self.sandwich:
            return self._fused(ops, ropes, hidden, meta, kv_cache)
        attn = self.self_attn(ropes, self.input_layernorm(hidden), meta, kv_cache, ops)
        if not self.sandwich:
            hidden = hidden + attn
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


    def _fused(self, ops: flash_ops.FlashOps, ropes, hidden, meta, kv_cache):
        """``forward`` through flash-attn's fused kernels: the residual add and the second norm
        in one, rope in one, SiLU * up in one."""
        attn = self.self_attn(ropes, self.input_layernorm.flash(ops.rms_norm_fn, hidden), meta, kv_cache, ops)
        normed, hidden = self.post_attention_layernorm.flash(ops.rms_norm_fn, attn, hidden)  # hidden + attn, normed
        mlp = self.mlp(normed, ops.swiglu) if isinstance(self.mlp, LlamaMLP) else self.mlp(normed)
        return hidden + mlp


def kvcache_step(meta, ops: flash_ops.FlashOps | None, head_dim: int) -> KVCacheStep | None:
    """The step as one ``flash_attn_with_kvcache`` call a layer (chains of one length on the
    flash_attn backend, with the fused kernels), or None. Its rotary takes head dims divisible by 16."""
    if ops is None or head_dim % 16:
        return None
    return meta.kvcache


def fused_ops(meta) -> flash_ops.FlashOps | None:
    """flash-attn's fused kernels when the step runs on the flash_attn backend (where flash-attn
    loads, on CUDA in fp16/bf16), else None: the other backends keep the torch and C paths."""
    if isinstance(meta, VarlenMetadata) and meta.kernel is flash_kernel:
        return flash_ops.load()
    return None


class LlamaForCausalLM(nn.Module):
    """``forward`` gives final hidden states; ``compute_logits`` the vocab logits.

    ``num_layers`` < config.num_hidden_layers builds only the first layers (the
    self-drafting early-exit model shares them with the full target). ``arch``: the
    family's (``engine.models.registry``); default Llama's of ``config``.
    """

    def __init__(self, config, tp: TPGroup = SINGLE, max_positions: int | None = None, arch: Arch | None = None):
        super().__init__()
        self.config = config
        self.arch = arch = arch or llama_arch(config)
        self.min_rows = 1  # oneDNN matmul inputs of fewer rows are padded (set by prepack)
        self.fused: FusedLayers | None = None  # the layers as one C call each, where they run so (set by prepack)
        max_positions = max_positions or config.max_position_embeddings
        self.rotaries = nn.ModuleDict({
            kind: RotaryEmbedding(config, arch.head_dim, max_positions, kind) for kind in dict.fromkeys(arch.rope_kinds)
        })
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, i, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.eps, arch.norm_offset)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp)
        if arch.tie_word_embeddings:
            self.embed_tokens.tie(self.lm_head)

    @property
    def rotary(self) -> RotaryEmbedding:
        """The first layer's rope (its table's length is the model's largest position)."""
        return self.rotaries[self.arch.rope_kinds[0]]

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_cache, num_layers=None, capture=()):
        """input_ids [T], positions [T] -> final-normed hidden states [T, hidden].

        ``capture`` (layer ids; EAGLE drafters): also return the hidden states entering
        each of those layers, id ``num_hidden_layers`` meaning the final-normed output,
        concatenated in that order: ``(hidden [T, hidden], features [T, len(capture) * hidden])``.
        """
        hidden = self.embed_tokens(input_ids)
        if self.arch.embed_scale is not None:
            hidden = hidden * torch.tensor(self.arch.embed_scale, dtype=hidden.dtype, device=hidden.device)
        ropes = self.ropes(positions, hidden.dtype, meta)
        fused = None if self.fused is None else self.fused.step(hidden, ropes, meta)  # each layer one C call
        taken = {}
        for i, layer in enumerate(self.layers):  # not self.layers[:num_layers]: slicing builds a new ModuleList each step
            if i == num_layers:
                break
            if i in capture:
                taken[i] = hidden.clone() if fused else hidden  # a fused layer writes in place
            if fused:
                fused.layer(i, hidden, kv_cache)
            else:
                hidden = layer(ropes, hidden, meta, kv_cache)
        hidden = self.norm(hidden)
        if not capture:
            return hidden
        taken[len(self.layers)] = hidden
        return hidden, torch.cat([taken[i] for i in capture], dim=-1)

    def ropes(self, positions, dtype: torch.dtype, meta) -> dict:
        """Rope kind -> the step's (cos, sin): [T, 1, D] in ``dtype``; with flash-attn's fused
        kernels their halves [T, D / 2]; for a ``kvcache_step`` the whole half tables [rows, D / 2],
        read at each request's context_len + i (``positions`` is that for every chain the runner feeds)."""
        ops = fused_ops(meta)
        step = kvcache_step(meta, ops, self.arch.head_dim)
        if step is not None:
            rows = step.block_table.shape[1] * meta.block_size  # the cache's reach
            return {kind: rotary.half_table(dtype, rows) for kind, rotary in self.rotaries.items()}
        if ops is not None:
            return {kind: rotary.halves(positions) for kind, rotary in self.rotaries.items()}
        return {kind: rotary(positions, dtype) for kind, rotary in self.rotaries.items()}

    def prepack(self, quantize: tuple[str, str] | None = None) -> None:
        """Weights are final: let the linear layers lay them out for the C matmul (or, without
        it, for oneDNN, timing whether short inputs run faster padded: ``calibrate_min_rows``;
        or ``quantize`` them: GGUF types of the layers and of the head), and take the layers'
        addresses for whole-layer kernel calls (``fused``: ``engine.layers.cpu_decoder``)."""
        if self.arch.tie_word_embeddings:
            self.embed_tokens.tie(self.lm_head)
        linears = [m for m in self.modules() if isinstance(m, PackedLinear)]
        for module in linears:
            module.prepack(quantize and quantize[module is self.lm_head])
        self.embed_tokens.pack_quantized()
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.prepack()
        self.min_rows = calibrate_min_rows(linears)
        self.fused = FusedLayers.pack(self.layers, self.arch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in float32 (soft-capped where the family caps them)."""
        logits = self.lm_head(hidden).float()
        cap = self.arch.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

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
        name = hf_name
        for old, new in self.arch.weight_renames:
            name = name.replace(old, new)
        name = name.removeprefix("model.")
        if "rotary_emb" in name:
            return False
        if name == "lm_head.weight" and self.arch.tie_word_embeddings:
            return False
        if ".experts." in name:  # the MoE module takes its experts' tensors by expert id
            module, _, rest = name.partition(".experts.")
            self.get_submodule(module).load_expert(rest, tensor)
            return True
        shard_id = None
        for hf_part, (ours, sid) in self.STACKED.items():
            if hf_part in name:
                name, shard_id = name.replace(hf_part, ours), sid
                break
        module_name, _, param = name.rpartition(".")
        if param not in ("weight", "bias"):
            raise ValueError(f"unexpected parameter {hf_name}")
        module = self.get_submodule(module_name)
        if shard_id is None and isinstance(module, ColumnParallelLinear) and len(module.parts) > 1:
            module.load_fused(tensor, param)  # the checkpoint's own stack (Phi-3's qkv_proj, gate_up_proj)
        else:
            module.load(shard_id, tensor, param)  # copy_ converts the dtype
        return True
