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
import math
import mmap
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map

from engine.worker import model_store
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

    read_header(path)  # a malformed file is refused here, by name, before transformers parses it
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    try:
        try:
            AutoConfig.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
            AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
        except Exception as e:
            raise CheckpointError(f"{path}: its metadata gives no config and tokenizer ({type(e).__name__}: {e})") from e
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
MAX_DIMS = 4  # GGML_MAX_DIMS


class CheckpointError(ValueError):
    """A model file that does not hold what it claims (truncated, corrupt, or not for this
    model): the message names the file and, where one is at fault, the tensor."""


class _Cursor:
    """Reads little-endian GGUF fields from ``data``, every read checked against its end."""

    def __init__(self, data, path: Path):
        self.data, self.path, self.pos = data, path, 0

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what} (a truncated or corrupt GGUF file)")

    def skip(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.data):
            raise self.fail(f"{what} at byte {self.pos} runs past the end of the file ({len(self.data)} bytes)")
        self.pos += n

    def take(self, fmt: str, what: str):
        size = struct.calcsize("<" + fmt)
        self.skip(size, what)
        return struct.unpack_from("<" + fmt, self.data, self.pos - size)[0]

    def string(self, what: str) -> str:
        n = self.take("Q", what)
        self.skip(n, what)
        return self.data[self.pos - n : self.pos].decode("utf-8", "replace")

    def value(self, kind: int, key: str):
        """A metadata value of type ``kind``; arrays are skipped (None)."""
        if kind == _STRING:
            return self.string(f"the value of {key}")
        if kind in _SCALARS:
            return self.take(_SCALARS[kind], f"the value of {key}")
        if kind != _ARRAY:
            raise self.fail(f"metadata {key} has the unknown type {kind}")
        item, count = self.take("I", f"the array {key}"), self.take("Q", f"the array {key}")
        if item in _SCALARS:
            self.skip(count * struct.calcsize(_SCALARS[item]), f"the array {key}")
            return None
        if count * 8 > len(self.data) - self.pos:
            raise self.fail(f"the array {key} claims {count} items, more than the file holds")
        for _ in range(count):
            self.value(item, key)
        return None


def read_header(path: Path) -> tuple[dict, list[TensorInfo]]:
    """The file's scalar and string metadata (arrays skipped: the vocabulary, the merges) and
    its tensors' names, types, shapes and offsets, read straight from the GGUF layout: the
    ``gguf`` package's reader parses every array element (half a minute for a 49k-token
    vocabulary on a busy machine). Every count, length and offset is checked against the
    file: ``CheckpointError`` names the file and the field or tensor at fault."""
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            raise CheckpointError(f"{path} is empty")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if data[:4] != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file")
    cur = _Cursor(data, path)
    cur.pos = 4
    _, n_tensors, n_kv = cur.take("I", "the version"), cur.take("Q", "the tensor count"), cur.take("Q", "the metadata count")
    for count, least, what in ((n_kv, 13, "metadata entries"), (n_tensors, 24, "tensors")):
        if count * least > len(data) - cur.pos:
            raise cur.fail(f"it claims {count} {what}, more than its {len(data)} bytes hold")
    meta = {}
    for _ in range(n_kv):
        key = cur.string("a metadata key")
        meta[key] = cur.value(cur.take("I", f"the type of {key}"), key)
    infos = [_tensor_info(cur) for _ in range(n_tensors)]
    align = meta.get("general.alignment") or 32
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0:
        raise cur.fail(f"general.alignment is {align!r}")
    start = -(-cur.pos // align) * align
    infos = [TensorInfo(t.name, t.kind, t.shape, start + t.offset) for t in infos]
    for t in infos:
        _check_extent(t, len(data), path)
    return meta, infos


def _tensor_info(cur: _Cursor) -> TensorInfo:
    """One entry of the tensor table: name, dimensions, type, offset (from the data section)."""
    name = cur.string("a tensor name")
    dims = cur.take("I", f"the dimension count of tensor {name}")
    if not 1 <= dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name} has {dims} dimensions")
    shape = tuple(cur.take("Q", f"the shape of tensor {name}") for _ in range(dims))[::-1]  # innermost first in GGUF
    code = cur.take("I", f"the type of tensor {name}")
    try:
        kind = GGMLQuantizationType(code)
    except ValueError:
        raise cur.fail(f"tensor {name} has the unknown type {code}") from None
    return TensorInfo(name, kind, shape, cur.take("Q", f"the offset of tensor {name}"))


def _check_extent(t: TensorInfo, file_size: int, path: Path) -> None:
    """CheckpointError unless tensor ``t``'s shape is whole blocks of its type and its bytes lie in the file."""
    block, size = GGML_QUANT_SIZES.get(t.kind, (0, 0))
    if not block or min(t.shape) < 1 or t.shape[-1] % block:
        raise CheckpointError(f"{path}: tensor {t.name} of shape {t.shape} is not whole {t.kind.name} blocks")
    end = t.offset + math.prod(t.shape[:-1]) * (t.shape[-1] // block) * size
    if end > file_size:
        raise CheckpointError(f"{path}: tensor {t.name}'s data (bytes {t.offset} to {end}) runs past the end of the "
                              f"file ({file_size} bytes): a truncated or corrupt GGUF file")


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
            raise CheckpointError(f"{path}: GGUF tensor {t.name} has no place in a {arch} model")
        check_shape(path, t.name, name, t.shape, config)
        tensor = _tensor(data, t, dequantize)
        proj = name.split(".")[-2]
        if arch in PERMUTED_QK and proj in heads:
            tensor = _permute(tensor, heads[proj])
        yield name, tensor


def expected_shape(hf_name: str, config) -> tuple[int, ...] | None:
    """The shape a Llama-family checkpoint tensor must have under ``config``; None for a name
    outside the common table (its family's own checks apply)."""
    parts = hf_name.split(".")
    if len(parts) < 2 or not all(hasattr(config, a) for a in ("hidden_size", "num_attention_heads", "vocab_size")):
        return None
    h, (module, param) = config.hidden_size, parts[-2:]
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    inter = getattr(config, "intermediate_size", None)
    dense_mlp = len(parts) == 6 and parts[3] == "mlp" and isinstance(inter, int)
    rows = {"q_proj": heads * d, "k_proj": kv * d, "v_proj": kv * d}
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (config.vocab_size, h)
    if module in ("norm", "input_layernorm", "post_attention_layernorm") and param == "weight":
        return (h,)
    if module in rows and parts[-3] == "self_attn":
        return (rows[module], h) if param == "weight" else (rows[module],)
    if module == "o_proj" and param == "weight":
        return (h, heads * d)
    if dense_mlp and param == "weight":
        return (h, inter) if module == "down_proj" else (inter, h) if module in ("gate_proj", "up_proj") else None
    return None


def check_shape(path: Path, name: str, hf_name: str, shape: tuple[int, ...], config) -> None:
    """CheckpointError when tensor ``name`` (``hf_name`` in the model) has not the shape ``config`` gives it."""
    want = expected_shape(hf_name, config)
    if want is not None and tuple(shape) != want:
        raise CheckpointError(f"{path}: tensor {name} has shape {tuple(shape)}, the model's config needs {want}")


def _permute(tensor, heads: int):
    if isinstance(tensor, QuantTensor):
        return QuantTensor(tensor.kind, _unpermute(tensor.data, heads), tensor.cols)
    return _unpermute(tensor, heads)
