"""Builds our model from a local checkpoint: safetensors directory or GGUF file.

Weights are read only through safetensors or GGUF, never through pickle. Under
tensor parallelism each rank loads only its shard: from safetensors every layer
slices the memory-mapped file lazily (``get_slice``), so a rank reads its own
rows and columns and never holds the full model. A GGUF file has no such lazy
slices here: transformers dequantizes the whole checkpoint on every rank, which
then keeps only its shard (convert the model to safetensors to avoid it, as
``engine.model_store`` does for the default model).
"""

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer

from engine.models.llama import LlamaForCausalLM
from engine.parallel import SINGLE, TPGroup

SUPPORTED = {"llama", "mistral", "qwen3"}


def load_config(path: Path):
    if path.suffix == ".gguf":
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    return AutoConfig.from_pretrained(path)


def load_tokenizer(path: Path):
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path)


def _checkpoint_tensors(path: Path):
    """Yields ``(hf_name, tensor)`` pairs of a checkpoint; from safetensors the
    "tensor" is a lazy slice that reads only the part indexed (``t[a:b]``, ``t[:, a:b]``)."""
    if path.suffix == ".gguf":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        yield from hf.state_dict().items()
        return
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_slice(name)


def load_model(
    path: Path, dtype: torch.dtype, device: torch.device, tp: TPGroup = SINGLE, max_positions: int | None = None
) -> LlamaForCausalLM:
    config = load_config(path)
    if config.model_type not in SUPPORTED:
        raise ValueError(f"model type {config.model_type!r} is not supported (supported: {sorted(SUPPORTED)})")
    with torch.device("meta"):  # no memory, no initialization: the checkpoint fills the weights
        model = LlamaForCausalLM(config, tp, max_positions)
    materialize(model, dtype, device)
    for name, tensor in _checkpoint_tensors(path):
        model.load_weight(name, tensor)
    check_filled(model, path)
    model.prepack()
    return model.eval()


def weight_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of the model of ``config`` in ``dtype`` (built on meta, so nothing is allocated)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return sum(p.numel() * (dtype.itemsize if p.is_floating_point() else p.element_size()) for p in model.parameters())


def materialize(module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Gives each parameter still on ``meta`` memory on ``device``, in ``dtype`` when it is
    a floating-point one (tied parameters stay tied), filled with NaN until the checkpoint
    fills it (``check_filled``); moves every buffer (computed tables, ``rotary.table_device``)
    to ``device``. So loading holds the weights in the serving dtype only: never a float32
    copy of them, which would double a bf16 model's peak."""
    made: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in made:
                    t = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device=device)
                    made[id(p)] = nn.Parameter(t.fill_(float("nan")) if t.is_floating_point() else t, requires_grad=False)
                m._parameters[name] = made[id(p)]
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)


def check_filled(model: nn.Module, path: Path) -> None:
    """ValueError naming the floating-point parameters the checkpoint left unfilled (NaN)."""
    params = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
    unfilled = torch.stack([p.isnan().any() for _, p in params]).tolist()  # one host sync for all
    missing = [n for (n, _), bad in zip(params, unfilled) if bad]
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights (or holds NaN) for {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
