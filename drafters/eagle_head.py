"""EAGLE draft heads in the published checkpoint formats, and their loader.

Both kinds are one decoder layer that reads pairs ``(feature f_p, token t_{p+1})``:
the target's feature at position p and the embedding (the target's own) of the
token after it; its output at pair p drafts token ``t_{p+2}``. Drafting further,
the head's own output stands in for the feature it has not got.

- ``eagle`` (EAGLE-1/2, SafeAILab format): the feature is the target's final-normed
  hidden state; ``fc`` maps ``[embedding; feature]`` (2H) to H; layer 0 has no input
  norm; the output goes through the target's own ``lm_head``. Names: ``fc.weight``
  (``fc.bias`` optional), ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``.
- ``eagle3`` (EAGLE-3): the feature is the residual stream entering a low, a middle and
  a high target layer (``eagle_aux_hidden_state_layer_ids``, default ``(2, L // 2, L - 3)``),
  fused by ``fc`` (3H -> H) for the target's pairs only; attention reads
  ``[input_layernorm(embedding); hidden_norm(hidden)]`` (2H) with the un-normed hidden as
  residual; ``norm`` and a ``lm_head`` over a reduced draft vocabulary; ``d2t`` maps draft id
  i to target id ``i + d2t[i]``. Names: ``fc.weight``, ``midlayer.*``, ``norm.weight``,
  ``lm_head.weight``, ``d2t``, ``t2d``.

Weights are read from ``*.safetensors`` only (never a pickle); a ``model.`` prefix is
accepted; ``embed_tokens.weight`` is ignored (the target's is used).
"""

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.layers import cpu_decoder, cpu_kernels
from engine.layers.linear import CFloat32Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models.decoder import head_dim_of

KINDS = ("eagle", "eagle3")


class EagleHead(nn.Module):
    """One EAGLE decoder layer on a paged KV cache of its own (one layer)."""

    def __init__(self, config, kind: str, target, max_positions: int, feature_layers: tuple[int, ...]):
        super().__init__()
        H, self.kind, self.config = config.hidden_size, kind, config
        self.feature_layers = feature_layers
        self._target = (target,)  # shared embedding (and eagle: lm_head); a tuple keeps its parameters out of ours
        self.head_dim = head_dim_of(config)
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        attn_in = 2 * H if kind == "eagle3" else H
        fc_in = len(feature_layers) * H if kind == "eagle3" else 2 * H
        self.fc = nn.Linear(fc_in, H, bias=getattr(config, "bias", False))
        self.q_proj = nn.Linear(attn_in, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(attn_in, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(attn_in, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=False)
        inter = config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(H, inter, bias=False), nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, self.head_dim, max_positions)
        if kind == "eagle3":
            self.input_layernorm = RMSNorm(H, config.rms_norm_eps)
            self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
            self.norm = RMSNorm(H, config.rms_norm_eps)
            draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
            self.lm_head = nn.Linear(H, draft_vocab, bias=False)
            self.register_buffer("draft_to_target", torch.arange(draft_vocab), persistent=False)
        self._fused = None  # ``cpu_kernels.layer_args`` once ``prepare_fused`` ran

    def prepare_fused(self) -> None:
        """Weights are final and the head drafts on the CPU in float32: each matrix multiplies by
        the C matmul (``CFloat32Linear``, read by ``_linear``), and the layer runs in one
        ``cpu_kernels.decoder_layer`` call: through the layer's 20-odd torch and kernel calls,
        a drafting pass is mostly dispatch. The attention input comes whole, so the
        post-attention norm stands in the input norm's unused place."""
        if self.fc.weight.dtype != torch.float32 or self.fc.weight.device.type != "cpu" or cpu_kernels.load() is None:
            return
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.linear_kernel = CFloat32Linear(m.weight.detach())
        w = lambda *ms: tuple(m.weight.detach() for m in ms)  # noqa: E731
        self._fused = cpu_decoder.separate_layer_args(
            self.config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.post_attention_layernorm,
            w(self.q_proj, self.k_proj, self.v_proj), self.o_proj.weight.detach(), w(self.gate_proj, self.up_proj),
            self.down_proj.weight.detach())

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [T, F] -> the hidden input of the head's pairs [T, H]
        (eagle3: ``fc`` fuses the layers; eagle: the feature itself)."""
        return _linear(self.fc, features) if self.kind == "eagle3" else features

    def layer_inputs(self, input_ids: torch.Tensor, hidden: torch.Tensor):
        """input_ids [T], hidden [T, H] -> (residual [T, H], attention input [T, H or 2H])."""
        emb = self._target[0].embed_tokens(input_ids).to(hidden.dtype)
        if self.kind == "eagle3":
            return hidden, torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        x = _linear(self.fc, torch.cat([emb, hidden], dim=-1))
        return x, x  # layer 0 of EAGLE-1 has no input norm

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, attn_in] -> q [T, heads, D], k and v [T, kv_heads, D], rope applied."""
        q = _linear(self.q_proj, x).view(-1, self.num_heads, self.head_dim)
        k = _linear(self.k_proj, x).view(-1, self.num_kv_heads, self.head_dim)
        v = _linear(self.v_proj, x).view(-1, self.num_kv_heads, self.head_dim)
        cos, sin = self.rotary(positions, x.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """attn [T, heads * D] -> the layer's output [T, H] (pre-norm)."""
        x = residual + _linear(self.o_proj, attn)
        h = self.post_attention_layernorm(x)
        return x + _linear(self.down_proj, F.silu(_linear(self.gate_proj, h)) * _linear(self.up_proj, h))

    def forward(self, input_ids, hidden, positions, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        """input_ids [T], hidden [T, H] (fused), positions [T] -> output hidden [T, H]."""
        residual, x = self.layer_inputs(input_ids, hidden)
        if self._fused is not None and isinstance(meta, AttentionMetadata) and meta.lists_all(len(x)) \
                and cpu_kernels.usable(x):
            return self._fused_forward(residual, x, positions, meta, kv_cache)
        q, k, v = self.qkv(x, positions)
        out = paged_attention(q, k, v, kv_cache.layer(0), meta)  # [T, heads, D]
        return self.finish(residual, out.reshape(-1, self.num_heads * self.head_dim))

    def _fused_forward(self, residual, x, positions, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        """``forward`` in one ``cpu_kernels.decoder_layer`` call: residual [T, H], x the
        attention's input [T, attn_in] -> output [T, H] (a new tensor)."""
        cfg = self.config
        out = residual.clone(memory_format=torch.contiguous_format)  # the kernel works in place
        cos, sin = (r.contiguous() for r in self.rotary(positions, x.dtype))
        scratch = torch.empty(cpu_kernels.scratch_size(len(x), cfg.hidden_size, self.num_heads, self.num_kv_heads,
                                                       self.head_dim, cfg.intermediate_size))
        step = cpu_kernels.step_args(cos, sin, *meta.listed_args(), scratch)
        cpu_kernels.decoder_layer(out, self._fused, *kv_cache.layer(0), step, attn_in=x.contiguous())
        return out

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """out [S, H] -> logits over the TARGET vocabulary [S, vocab], float32 (tokens
        outside a reduced draft vocabulary get -inf: they are never drafted)."""
        if self.kind == "eagle":
            return self._target[0].compute_logits(out)
        small = self._draft_vocab_logits(out)
        full = small.new_full((out.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = small
        return full

    def draft_argmax(self, out: torch.Tensor) -> torch.Tensor:
        """out [S, H] -> the target id of each row's largest draft logit [S], as
        ``draft_logits(out).argmax(-1)`` without spreading the logits over the target
        vocabulary (ties aside)."""
        if self.kind == "eagle":
            return self._target[0].compute_logits(out).argmax(-1)
        return self.draft_to_target[self._draft_vocab_logits(out).argmax(-1)]

    def _draft_vocab_logits(self, out: torch.Tensor) -> torch.Tensor:
        """eagle3: out [S, H] -> logits over the draft vocabulary [S, draft_vocab], float32."""
        return _linear(self.lm_head, self.norm(out)).float()

    def num_parameters(self) -> int:
        """Parameters read per drafted token, including the target's head it uses."""
        own = sum(p.numel() for p in self.parameters())
        return own + (self._target[0].lm_head.weight.numel() if self.kind == "eagle" else 0)


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, through the C matmul where ``prepare_fused`` chose it (``CFloat32Linear``,
    itself ``F.linear`` under autograd: training); it runs the head's small matmuls several
    times faster than torch's."""
    kernel = getattr(layer, "linear_kernel", None)
    if kernel is not None and x.dim() == 2:
        y = kernel(x, layer.weight)
        return y if layer.bias is None else y + layer.bias
    return layer(x)


def load_eagle_head(path: Path, kind: str, target, dtype, device, max_positions: int) -> EagleHead:
    """The head in ``path`` (config.json + *.safetensors), checked against ``target``;
    ValueError with the reason when it does not fit."""
    config = _read_config(path)
    layers = _feature_layers(config, kind, target.config.num_hidden_layers)
    _check_fits(config, kind, target.config, layers)
    with torch.device(device):
        head = EagleHead(config, kind, target, max_positions, layers)
    tensors = _read_tensors(path)
    _load(head, tensors, kind)
    for p in head.parameters():
        p.data = p.data.to(dtype)
        p.requires_grad_(False)
    head.prepare_fused()
    return head.eval()


def _read_config(path: Path):
    from transformers import LlamaConfig

    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"EAGLE head {path}: no config.json")
    raw = json.loads(file.read_text())
    raw.pop("architectures", None)
    raw.pop("model_type", None)
    return LlamaConfig(**raw)


def _feature_layers(config, kind: str, num_target_layers: int) -> tuple[int, ...]:
    """Target layer ids whose input hidden states the head reads (id L: the final-normed output)."""
    if kind == "eagle":
        return (num_target_layers,)
    eagle_config = getattr(config, "eagle_config", None) or {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") or getattr(
        config, "eagle_aux_hidden_state_layer_ids", None
    )
    return tuple(ids) if ids else (2, num_target_layers // 2, num_target_layers - 3)


def _check_fits(config, kind: str, target_config, layers: tuple[int, ...]) -> None:
    where = f"EAGLE head ({kind})"
    if config.hidden_size != target_config.hidden_size:
        raise ValueError(f"{where}: hidden size {config.hidden_size} differs from the target's {target_config.hidden_size}")
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(f"{where}: vocabulary of {config.vocab_size} differs from the target's {target_config.vocab_size}")
    if getattr(config, "num_hidden_layers", 1) != 1:
        raise ValueError(f"{where}: only one-layer heads are supported, got {config.num_hidden_layers}")
    bad = [i for i in layers if not 0 <= i < target_config.num_hidden_layers]
    if kind == "eagle3" and (len(layers) != 3 or bad):
        raise ValueError(
            f"{where}: feature layer ids {list(layers)} must be three layers of the target's "
            f"{target_config.num_hidden_layers}"
        )


def head_memory(path: Path, dtype: torch.dtype, block_size: int, kv_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(bytes of the head's own weights in ``dtype``, bytes of its one-layer KV cache of
    ``kv_dtype`` (default ``dtype``) per block), read from its config and safetensors headers
    without loading a tensor."""
    from safetensors import safe_open

    config = _read_config(path)
    count = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            count += sum(math.prod(st.get_slice(n).get_shape()) for n in st.keys() if not n.endswith("embed_tokens.weight"))
    kv = 2 * block_size * config.num_key_value_heads * head_dim_of(config) * (kv_dtype or dtype).itemsize
    return count * dtype.itemsize, kv


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"EAGLE head {path}: no *.safetensors files (pickled .bin checkpoints are never loaded: "
            "convert them to safetensors first)"
        )
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            tensors.update({name.removeprefix("model."): st.get_tensor(name) for name in st.keys()})
    tensors.pop("embed_tokens.weight", None)
    return tensors


def _load(head: EagleHead, tensors: dict[str, torch.Tensor], kind: str) -> None:
    """Copies every checkpoint tensor into place; refuses unknown, missing or misshapen ones."""
    layer = "midlayer." if kind == "eagle3" else "layers.0."
    params = dict(head.named_parameters())
    t2d = tensors.pop("t2d", None)
    if kind == "eagle3" and "d2t" in tensors:
        d2t = tensors.pop("d2t").long()
        head.draft_to_target.copy_(torch.arange(len(d2t)) + d2t)
        _check_vocab_map(head.draft_to_target, t2d, head.config.vocab_size)
    elif kind == "eagle3" and len(head.draft_to_target) != head.config.vocab_size:
        raise ValueError("EAGLE head: a reduced draft vocabulary needs its d2t mapping")
    for name, tensor in tensors.items():
        ours = name.removeprefix(layer).replace("self_attn.", "").replace("mlp.", "")
        if ours not in params or "rotary" in ours:
            raise ValueError(f"EAGLE head: unexpected tensor {name!r} in the checkpoint")
        if params[ours].shape != tensor.shape:
            raise ValueError(f"EAGLE head: {name} has shape {list(tensor.shape)}, expected {list(params[ours].shape)}")
        params[ours].data.copy_(tensor)
        params.pop(ours)
    if params:
        raise ValueError(f"EAGLE head: checkpoint lacks {sorted(params)}")


def _check_vocab_map(draft_to_target: torch.Tensor, t2d: torch.Tensor | None, vocab: int) -> None:
    if draft_to_target.min() < 0 or draft_to_target.max() >= vocab:
        raise ValueError(f"EAGLE head: d2t maps draft tokens outside the target vocabulary [0, {vocab})")
    if t2d is not None and (len(t2d) != vocab or t2d.bool().sum() != len(draft_to_target)):
        raise ValueError("EAGLE head: t2d does not match d2t and the target vocabulary")


ARCHITECTURES = {"eagle": "LlamaForCausalLMEagle", "eagle3": "LlamaForCausalLMEagle3"}


def save_eagle_head(head: EagleHead, path: Path) -> None:
    """Writes ``head`` in its published format (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    layer = "midlayer." if head.kind == "eagle3" else "layers.0."
    tensors = {}
    for name, p in head.named_parameters():
        if name.endswith("_proj.weight") and name[0] in "qkvo":
            name = f"{layer}self_attn.{name}"
        elif name.endswith("_proj.weight"):
            name = f"{layer}mlp.{name}"
        elif name.split(".")[0] in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            name = layer + name
        tensors[name] = p.detach().float().contiguous()
    config = head.config.to_dict()
    if head.kind == "eagle3":
        d2t = head.draft_to_target.cpu()
        tensors["d2t"] = d2t - torch.arange(len(d2t))
        t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
        t2d[d2t] = True
        tensors["t2d"] = t2d
        config["draft_vocab_size"] = len(d2t)
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(head.feature_layers)}
    config.update(architectures=[ARCHITECTURES[head.kind]], model_type="llama", num_hidden_layers=1)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2, default=str))
