"""The tensors of a GGUF checkpoint under Hugging Face names, quantized ones kept in their blocks.

``checkpoint_tensors`` reads the file (memory-mapped; ``read_header``) and yields
``(hf_name, tensor)``: float tensors (F32, F16, BF16) as float32 torch tensors, quantized
ones as ``QuantTensor`` (the file's block bytes, row by row) or, with ``dequantize``, as
float32. Names follow the ``gguf`` package's own tables; Llama-architecture files store
the q and k rows permuted (llama.cpp's rotary layout), which are put back in Hugging Face's
order (whole rows: the blocks run along the input features).

A quantized tensor whose type has no kernel (``quant.KERNEL_TYPES``) is refused at start-up
with its name and type, unless ``dequantize`` is asked for.

``metadata_dir`` keeps the config and tokenizer that ``transformers`` builds from a file's
metadata (slow for a large vocabulary) in the cache, keyed by the file's path, size and
time: later starts read them back.
"""

import hashlib
import mmap
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map

from engine import model_store
from engine.layers import quant
from engine.layers.quant import QuantTensor

FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")  # the files whose tensors this module names
PERMUTED_QK = ("llama",)  # architectures whose files store q and k rows permuted


def metadata_dir(path: Path) -> Path:
    """A directory with the config and tokenizer of the GGUF file at ``path`` (``save_pretrained``),
    built on first use."""
    stat = path.resolve().stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = model_store.cache_dir() / "gguf" / f"{path.stem}-{key}"
    if (out / "config.json").exists():
        return out
    from transformers import AutoConfig, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    try:
        AutoConfig.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
        tmp.rename(out)
    except OSError:  # built meanwhile by another process
        if not (out / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@dataclass(frozen=True)
class TensorInfo:
    name: str
    kind: GGMLQuantizationType
    shape: tuple[int, ...]  # outermost first, as torch orders it
    offset: int  # of its bytes in the file


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_header(path: Path) -> tuple[dict, list[TensorInfo]]:
    """The file's scalar and string metadata (arrays skipped: the vocabulary, the merges) and
    its tensors' names, types, shapes and offsets, read straight from the GGUF layout: the
    ``gguf`` package's reader parses every array element (half a minute for a 49k-token
    vocabulary on a busy machine)."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        value = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return value[0]

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return data[pos - n : pos].decode("utf-8", "replace")

    def value(kind: int):
        if kind == _STRING:
            return string()
        if kind != _ARRAY:
            return take(_SCALARS[kind])
        item, count = take("I"), take("Q")
        for _ in range(count):
            value(item)
        return None

    if data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    pos = 4
    _, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("I"))
    infos = []
    for _ in range(n_tensors):
        name, dims = string(), take("I")
        shape = tuple(take("Q") for _ in range(dims))[::-1]  # GGUF lists the innermost dimension first
        kind, offset = GGMLQuantizationType(take("I")), take("Q")
        infos.append(TensorInfo(name, kind, shape, offset))
    align = meta.get("general.alignment") or 32
    start = -(-pos // align) * align
    return meta, [TensorInfo(t.name, t.kind, t.shape, start + t.offset) for t in infos]


def hf_names(config, arch: str) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, for every tensor a Llama-family model may have."""
    kind = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if kind is None or arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not read quantized (supported: {', '.join(ARCHITECTURES)}); "
                         "serve it dequantized with --quantization none")
    table = get_tensor_name_map(kind, config.num_hidden_layers)
    names = ["model.embed_tokens", "lm_head", "model.norm"]
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        names += [f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
        names += [f"{layer}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        names += [f"{layer}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    out = {}
    for name in names:
        gguf_name = table.get_name(name)
        if gguf_name is not None:
            out[gguf_name + ".weight"], out[gguf_name + ".bias"] = name + ".weight", name + ".bias"
    return out


def _unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k weight (or bias) from llama.cpp's rotary order back to Hugging Face's
    (``transformers``' reverse permute): per head, rows [pairs, 2] -> [2, pairs]."""
    rows = t.shape[0]
    order = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    return t[order]


def check_types(infos: list[TensorInfo]) -> None:
    """ValueError naming the first tensor whose type the kernels cannot multiply."""
    for t in infos:
        if t.kind not in FLOAT_TYPES and t.kind.name not in quant.KERNEL_TYPES:
            raise ValueError(f"tensor {t.name} is {t.kind.name}, which has no kernel (supported: "
                             f"{', '.join(quant.KERNEL_TYPES)}, F32, F16, BF16); serve the file with --quantization none")


def _tensor(data: np.ndarray, t: TensorInfo, dequantize: bool):
    """A tensor of the file (``data``: its bytes, memory-mapped) as float32, or, quantized, as a
    QuantTensor [rows, row_bytes] (copied out of the map)."""
    block, size = GGML_QUANT_SIZES[t.kind]
    rows = int(np.prod(t.shape[:-1]))
    raw = data[t.offset : t.offset + rows * t.shape[-1] // block * size]
    if t.kind in FLOAT_TYPES:
        values = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(t.kind, np.int16)
        out = torch.from_numpy(raw.view(values).copy())
        out = out.view(torch.bfloat16) if t.kind == GGMLQuantizationType.BF16 else out
        return out.float().reshape(t.shape)
    q = QuantTensor(t.kind.name, torch.from_numpy(raw.reshape(rows, -1).copy()), t.shape[-1])
    return q.dequantize() if dequantize else q


def checkpoint_tensors(path: Path, config, dequantize: bool = False):
    """Yields ``(hf_name, tensor)`` for every tensor of the GGUF file at ``path``."""
    meta, infos = read_header(path)
    arch = meta.get("general.architecture")
    names = hf_names(config, arch)
    if not dequantize:
        check_types(infos)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in infos:
        name = names.get(t.name)
        if name is None:
            if t.name.startswith("rope_freqs"):  # llama.cpp's own rotary factors; the config has them
                continue
            raise ValueError(f"GGUF tensor {t.name} has no place in a {arch} model")
        tensor = _tensor(data, t, dequantize)
        proj = name.split(".")[-2]
        if arch in PERMUTED_QK and proj in heads:
            tensor = _permute(tensor, heads[proj])
        yield name, tensor


def _permute(tensor, heads: int):
    if isinstance(tensor, QuantTensor):
        return QuantTensor(tensor.kind, _unpermute(tensor.data, heads), tensor.cols)
    return _unpermute(tensor, heads)
