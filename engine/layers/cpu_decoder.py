"""The decoder's whole-layer CPU path: each layer one C call (``cpu_kernels.decoder_layer``).

Chosen once at load (``FusedLayers.pack``, from the model's ``prepack``): where the
family's layer has Llama's shape (``Arch.fusable``) and every layer's matrices are laid
out for the C matmul (or all in GGUF blocks), the layers' addresses are taken once. A
step whose tokens all attend through listed KV slots, float32 on the CPU outside
autograd, then runs each layer in one call (``FusedLayers.step``) instead of the layer
module: the same kernels in the same order, so the same bits, with no Python between them.
"""

import torch

from engine.layers import cpu_kernels, quant
from engine.layers.mlp import LlamaMLP


def layer_args(layer) -> tuple | None:
    """A decoder layer's ``cpu_kernels.layer_args`` (the whole layer in one C call), or None
    where it cannot run that way: no kernels, not float32 on the CPU, tensor parallel (its
    all-reduces sit between the kernels), matrices some in GGUF blocks and some not, or
    experts not in one C call (``SparseMoE.prepack``: its ``kernel``). Call after ``prepack``."""
    attn, mlp = layer.self_attn, layer.mlp
    w = attn.qkv_proj.weight
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    moe = None if isinstance(mlp, LlamaMLP) else getattr(mlp, "kernel", None)  # the experts' one-call arguments
    if (w.dtype != torch.float32 or norms[0].weight.device.type != "cpu"  # first: a GPU never builds kernels
            or not (isinstance(mlp, LlamaMLP) or moe is not None) or attn.o_proj.tp.size > 1
            or norms[0].eps != norms[1].eps or cpu_kernels.load() is None):
        return None
    linears = (attn.qkv_proj, attn.o_proj) + ((mlp.gate_up_proj, mlp.down_proj) if moe is None else ())
    matrices, matmul = tuple(m.kernel for m in linears), None
    if moe is None and all(m.qweight is not None for m in linears):  # GGUF blocks: quant.linear's matmul
        matrices, matmul = tuple(m.qweight.handle for m in linears), quant.layer_matmul()
    if any(m is None for m in matrices):  # not laid out for the kernel (not float32 on the CPU)
        return None
    bias = attn.qkv_proj.bias
    qk_norms = (attn.q_norm.weight.data, attn.k_norm.weight.data) if attn.qk_norm == "head" else None
    return cpu_kernels.layer_args(w.shape[1], attn.num_heads, attn.num_kv_heads, attn.head_dim, dense_inter(layer),
                                  norms[0].eps, (norms[0].weight.data, norms[1].weight.data),
                                  matrices + (None,) * (4 - len(matrices)), None if bias is None else bias.data,
                                  qk_norms, matmul=matmul, moe=moe)


def separate_layer_args(hidden: int, heads: int, kv_heads: int, head_dim: int, norm, qkv: tuple, o: torch.Tensor,
                        gate_up: tuple, down: torch.Tensor) -> cpu_kernels.LayerArgs:
    """A dense layer given as separate float32 weights (an EAGLE head's): q, k, v and gate, up
    stacked, every matrix laid out for the C matmul once, ``norm`` (an RMSNorm) in both norms'
    places; its ``cpu_kernels.layer_args``."""
    stack = lambda ws: cpu_kernels.kernel_weight(torch.cat(ws))  # noqa: E731
    matrices = (stack(qkv), cpu_kernels.kernel_weight(o), stack(gate_up), cpu_kernels.kernel_weight(down))
    return cpu_kernels.layer_args(hidden, heads, kv_heads, head_dim, down.shape[1], norm.eps,
                                  (norm.weight.data, norm.weight.data), matrices)


def dense_inter(layer) -> int:
    """The layer's gated MLP's intermediate features (0 for a mixture of experts)."""
    return layer.mlp.down_proj.weight.shape[1] if isinstance(layer.mlp, LlamaMLP) else 0


class FusedLayers:
    """A model's decoder layers as ``cpu_kernels.decoder_layer`` takes them: per layer its
    constant arguments and its (rope kind, window) key; ``sizes``: the scratch's sizes
    but the tokens and hidden (heads, KV heads, head dim, the widest dense MLP's width)."""

    def __init__(self, args: list[tuple], keys: list[tuple], sizes: tuple[int, ...]):
        self.args, self.keys, self.sizes = args, keys, sizes

    @classmethod
    def pack(cls, layers, arch) -> "FusedLayers | None":
        """``layers`` (the decoder layer modules, their weights prepacked) for the family's
        ``arch``, or None where one of them cannot run as one C call (``layer_args``)."""
        args = [layer_args(layer) for layer in layers] if arch.fusable else []
        if not args or not all(args):
            return None
        attn = layers[0].self_attn
        sizes = (attn.num_heads, attn.num_kv_heads, attn.head_dim, max(dense_inter(layer) for layer in layers))
        return cls(args, list(zip(arch.rope_kinds, arch.windows)), sizes)

    def step(self, hidden: torch.Tensor, ropes: dict, meta) -> "FusedStep | None":
        """This step's per-layer ``cpu_kernels.step_args`` (each layer's rope and window's) when
        it can run one C call per layer, else None: every token attended through listed KV
        slots (``AttentionMetadata.lists_all``; other backends' metadata lists none), hidden
        [T, hidden] float32 on the CPU outside autograd. ``ropes``: rope kind -> (cos, sin)."""
        t = hidden.shape[0]
        lists_all = getattr(meta, "lists_all", None)
        if lists_all is None or not lists_all(t) or not cpu_kernels.usable(hidden):
            return None
        kept, steps = [torch.empty(cpu_kernels.scratch_size(t, hidden.shape[1], *self.sizes))], {}
        for kind, window in dict.fromkeys(self.keys):
            cos, sin = (r.contiguous() for r in ropes[kind])
            listed = meta.for_window(window).listed_args()
            kept += [cos, sin, *listed]
            steps[kind, window] = cpu_kernels.step_args(cos, sin, *listed, kept[0])
        return FusedStep(self.args, [steps[key] for key in self.keys], kept)


class FusedStep:
    """One step's layers as C calls; ``kept``: the tensors its arguments point into."""

    def __init__(self, args: list[tuple], steps: list[tuple], kept: list[torch.Tensor]):
        self.args, self.steps, self.kept = args, steps, kept

    def layer(self, i: int, hidden: torch.Tensor, kv_cache) -> None:
        """Layer ``i`` in place on hidden [T, hidden] (contiguous), its keys and values into ``kv_cache``."""
        cpu_kernels.decoder_layer(hidden, self.args[i], *kv_cache.layer(i), self.steps[i])
