"""What a model family changes in the shared decoder (``engine.models.decoder``), as plain data.

Each family's file turns a checkpoint's Hugging Face config into an ``Arch``; the
decoder reads nothing else of the family. Per-layer fields (``windows``,
``rope_kinds``, ``moe_layers``) hold one entry per layer.
"""

from dataclasses import dataclass

from engine.layers.rotary import DEFAULT_ROPE, rope_parameters


@dataclass(frozen=True)
class MoESpec:
    """A sparse mixture-of-experts MLP: each token goes through ``top_k`` of ``num_experts``
    gated MLPs of ``intermediate_size``, weighted by the router's softmax over all experts
    (renormalized over the chosen ones when ``normalize``), plus, where there is one, a
    shared expert of ``shared_intermediate_size`` scaled by sigmoid(its gate) (Qwen2-MoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize: bool
    shared_intermediate_size: int = 0


@dataclass(frozen=True)
class Arch:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    eps: float
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # biases on q, k and v (Qwen2)
    o_bias: bool = False  # ... and on the attention output (Llama's attention_bias)
    mlp_bias: bool = False
    qk_norm: str | None = None  # "head": each q and k head rms-normed over D (Qwen3, Gemma 3); "full": all at once (OLMoE)
    norm_offset: float = 0.0  # every norm multiplies by (norm_offset + weight) (Gemma: 1)
    sandwich_norms: bool = False  # attention and MLP outputs normed before the residual add (Gemma 2/3)
    activation: str = "silu"  # of the gated MLP: "silu" or "gelu_tanh"
    embed_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # softmax scale; None: 1/sqrt(head_dim)
    attn_softcap: float | None = None  # attention scores -> softcap * tanh(s / softcap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    windows: tuple[int | None, ...] = ()  # per layer: sliding window (positions seen), None: all
    rope_kinds: tuple[str, ...] = ()  # per layer: its rope table's kind (Gemma 3: local and global; engine.layers.rotary)
    moe: MoESpec | None = None
    moe_layers: tuple[bool, ...] = ()  # per layer: a MoE MLP (else a dense one)
    weight_renames: tuple[tuple[str, str], ...] = ()  # checkpoint name fragment -> ours (Mixtral's experts)

    def __post_init__(self):
        for name in ("windows", "rope_kinds", "moe_layers"):
            if len(getattr(self, name)) != self.num_layers:
                raise ValueError(f"Arch.{name} needs one entry per layer ({self.num_layers})")

    @property
    def fusable(self) -> bool:
        """Whether a decoder layer of this family can run as one C call (``cpu_kernels.decoder_layer``):
        Llama's shape with at most qkv biases, per-head q/k norms, sliding windows and mixtures
        of experts."""
        return (not self.o_bias and not self.mlp_bias and self.qk_norm in (None, "head") and not self.norm_offset
                and not self.sandwich_norms and self.activation == "silu" and self.attn_scale is None
                and self.attn_softcap is None)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_windows(config) -> tuple[int | None, ...]:
    """Per layer: the sliding window of the config (``sliding_window`` on the layers that
    ``layer_types`` marks "sliding_attention", or on every layer when it has no
    ``layer_types``), None for full attention."""
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types is None:
        return (window,) * config.num_hidden_layers
    return tuple(window if t == "sliding_attention" else None for t in types)


def llama_arch(config, **changes) -> Arch:
    """The Llama family's ``Arch`` of ``config`` (Llama 2/3.x, SmolLM, Mistral: its sliding
    window), with ``changes`` on top (the families close to it)."""
    n = config.num_hidden_layers
    bias = bool(getattr(config, "attention_bias", False))
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu only)")
    if rope_parameters(config).get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    base = dict(
        hidden_size=config.hidden_size, num_layers=n, num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim_of(config), intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        eps=config.rms_norm_eps, tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)),
        windows=layer_windows(config), rope_kinds=(DEFAULT_ROPE,) * n,
        moe_layers=(False,) * n,
    )
    return Arch(**{**base, **changes})
