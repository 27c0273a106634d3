"""Gemma 2 and Gemma 3 (text): what they change in the shared decoder.

Norms multiply by ``1 + weight`` (stored as ``weight``), and four per layer: the
attention's and the MLP's outputs are normed before the residual add; embeddings
are scaled by sqrt(hidden_size); the MLP is GeGLU (tanh-approximated gelu); the
softmax scale is ``query_pre_attn_scalar ** -0.5``; sliding-window layers
alternate with global ones (``layer_types``: Gemma 2 every other layer, Gemma 3
five local to one global). Gemma 2 soft-caps attention scores and logits; Gemma 3
norms each q and k head instead, and gives its local layers their own rope base.
"""

from engine.models.arch import Arch, head_dim_of, layer_windows
from engine.layers.rotary import DEFAULT_ROPE


def _activation(config) -> str:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma activation {act!r} is not supported (gelu_pytorch_tanh)")
    return "gelu_tanh"


def _gemma_arch(config, **changes) -> Arch:
    n = config.num_hidden_layers
    base = dict(
        hidden_size=config.hidden_size, num_layers=n, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=head_dim_of(config),
        intermediate_size=config.intermediate_size, vocab_size=config.vocab_size, eps=config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        qkv_bias=bool(config.attention_bias), o_bias=bool(config.attention_bias), norm_offset=1.0,
        sandwich_norms=True, activation=_activation(config), embed_scale=config.hidden_size**0.5,
        attn_scale=config.query_pre_attn_scalar**-0.5, windows=layer_windows(config),
        rope_kinds=(DEFAULT_ROPE,) * n, moe_layers=(False,) * n,
    )
    return Arch(**{**base, **changes})


def gemma2_arch(config) -> Arch:
    return _gemma_arch(config, attn_softcap=config.attn_logit_softcapping,
                       final_softcap=config.final_logit_softcapping)


def gemma3_arch(config) -> Arch:
    kinds = tuple(config.layer_types)  # "sliding_attention" / "full_attention": each its own rope
    return _gemma_arch(config, qk_norm="head", attn_softcap=getattr(config, "attn_logit_softcapping", None),
                       final_softcap=getattr(config, "final_logit_softcapping", None), rope_kinds=kinds)
