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
    with torch.device(device):
        model = LlamaForCausalLM(config, tp, max_positions)
    for p in model.parameters():  # rope tables (buffers) stay float32
        p.data = p.data.to(dtype)
    for name, tensor in _checkpoint_tensors(path):
        model.load_weight(name, tensor)
    model.prepack()
    return model.eval()
