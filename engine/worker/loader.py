"""Builds our model from a local checkpoint: safetensors directory or GGUF file.

Weights are read only through safetensors or GGUF, never through pickle. Under
tensor parallelism each rank loads only its shard: from safetensors every layer
slices the memory-mapped file lazily (``get_slice``), so a rank reads its own
rows and columns and never holds the full model. A GGUF file is memory-mapped
(``engine.worker.gguf_file``): its quantized tensors stay in their blocks, the linear
layers' and the embedding's weights staying on meta (``quant.load_rows``), each rank
copying out its own rows (columns by whole blocks), unless ``quantization`` is
"none", the C kernels are off, or the model does not run in float32 on the CPU:
then they are dequantized at load. ``quantization`` "int8" / "int4" quantizes a
float checkpoint's linear layers at load (``quant.QUANTIZE_TO``).
"""

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer

from engine.worker import gguf_file
from engine.worker.gguf_file import CheckpointError
from engine.layers import quant
from engine.layers.linear import PackedLinear, VocabParallelEmbedding
from engine.models.decoder import LlamaForCausalLM
from engine.models.registry import arch_of
from engine.layers.parallel import SINGLE, TPGroup


def load_config(path: Path):
    return AutoConfig.from_pretrained(gguf_file.metadata_dir(path) if path.suffix == ".gguf" else path)


def load_tokenizer(path: Path):
    return AutoTokenizer.from_pretrained(gguf_file.metadata_dir(path) if path.suffix == ".gguf" else path)


# generation_config.json keys that set a request's default sampling (as vLLM's --generation-config auto)
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_config(path: Path) -> dict:
    """The checkpoint's ``generation_config.json`` as written ({} when it has none, or for a GGUF
    file): its ``eos_token_id`` ends generations, its sampling keys are requests' defaults."""
    file = path / "generation_config.json" if path.is_dir() else path.parent / "generation_config.json"
    if path.suffix == ".gguf" or not file.is_file():
        return {}
    import json

    return json.loads(file.read_text())


def _checkpoint_tensors(path: Path, config, dequantize: bool):
    """Yields ``(hf_name, tensor)`` pairs of a checkpoint; from safetensors the
    "tensor" is a lazy slice that reads only the part indexed (``t[a:b]``, ``t[:, a:b]``),
    from GGUF a ``QuantTensor`` for a quantized tensor unless ``dequantize``."""
    if path.suffix == ".gguf" and (not dequantize or config.model_type in gguf_file.ARCHITECTURES):
        yield from gguf_file.checkpoint_tensors(path, config, dequantize)
        return
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
        try:
            st = safe_open(str(f), framework="pt")
        except Exception as e:
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e
        with st:
            for name in st.keys():
                tensor = st.get_slice(name)
                gguf_file.check_shape(f, name, name, tuple(tensor.get_shape()), config)
                yield name, tensor


def keeps_quantized(quantization: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights stay (or become) quantized: float32 on the CPU with the kernels on, not "none"."""
    return quantization != "none" and dtype == torch.float32 and device.type == "cpu" and quant.load() is not None


def load_model(
    path: Path, dtype: torch.dtype, device: torch.device, tp: TPGroup = SINGLE, max_positions: int | None = None,
    quantization: str = "auto",
) -> LlamaForCausalLM:
    """``quantization``: "auto" (a GGUF file's own formats, a float checkpoint as it is), "none"
    (everything in ``dtype``), "int8" or "int4" (a float checkpoint quantized at load)."""
    if quantization in quant.QUANTIZE_TO and path.suffix == ".gguf":
        raise ValueError(f"--quantization {quantization} quantizes float checkpoints; a GGUF file keeps its own formats")
    config = load_config(path)
    arch = arch_of(config)  # ValueError for a family we do not serve, naming the ones we do
    with torch.device("meta"):  # no memory, no initialization: the checkpoint fills the weights
        model = LlamaForCausalLM(config, tp, max_positions, arch)
    quantized = keeps_quantized(quantization, dtype, device)
    gguf_blocks = quantized and path.suffix == ".gguf"
    materialize(model, dtype, device, skip=_block_weights(model) if gguf_blocks else ())
    for name, tensor in _checkpoint_tensors(path, config, dequantize=not quantized):
        try:
            model.load_weight(name, tensor)
        except (RuntimeError, ValueError, IndexError) as e:
            raise CheckpointError(f"{path}: tensor {name} does not fit the model ({e})") from e
    check_filled(model, path)
    try:
        model.prepack(quant.QUANTIZE_TO.get(quantization) if quantized else None)
    except ValueError as e:  # a quantized weight whose rows the file's tensors do not fill
        raise CheckpointError(f"{path}: {e}") from e
    return model.eval()


def weight_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of the model of ``config`` in ``dtype`` (built on meta, so nothing is allocated)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, arch=arch_of(config))
    return sum(p.numel() * (dtype.itemsize if p.is_floating_point() else p.element_size()) for p in model.parameters())


def _block_weights(model: nn.Module) -> set[int]:
    """The ids of the weights a GGUF file may fill in its blocks: linear layers' and embeddings'."""
    return {id(m.weight) for m in model.modules() if isinstance(m, (PackedLinear, VocabParallelEmbedding))}


def materialize(module: nn.Module, dtype: torch.dtype, device: torch.device, skip=()) -> None:
    """Gives each parameter still on ``meta`` memory on ``device``, in ``dtype`` when it is
    a floating-point one (tied parameters stay tied), filled with NaN until the checkpoint
    fills it (``check_filled``), except those in ``skip`` (ids: left on meta); moves every buffer
    (computed tables, ``rotary.table_device``) to ``device``. So loading holds the weights in the
    serving dtype only: never a float32 copy of them, which would double a bf16 model's peak."""
    made: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_meta and id(p) not in skip:
                if id(p) not in made:
                    t = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device=device)
                    made[id(p)] = nn.Parameter(t.fill_(float("nan")) if t.is_floating_point() else t, requires_grad=False)
                m._parameters[name] = made[id(p)]
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)


def check_filled(model: nn.Module, path: Path) -> None:
    """ValueError naming the floating-point parameters the checkpoint left unfilled (NaN). Those
    left on meta are held in GGUF blocks (their rows are checked by ``QuantRows.args``)."""
    params = [(n, p) for n, p in model.named_parameters() if p.is_floating_point() and not p.is_meta]
    unfilled = torch.stack([p.isnan().any() for _, p in params]).tolist()  # one host sync for all
    missing = [n for (n, _), bad in zip(params, unfilled) if bad]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks weights (or holds NaN) for {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
