"""Untrusted model files: a GGUF file with its header, metadata or tensor table mutated
(truncated, wrong dimensions, offsets past the end, huge counts, wrong types) and a
safetensors file with its header mutated each fail start-up (``load_model``) with a
``CheckpointError`` that names the file, and the tensor where one is at fault: never a
crash, a hang or a numpy traceback. A mutation that leaves a readable file may load.
Every candidate runs in this process under a timeout."""

import json
import random
import signal
import struct
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader

from engine.worker.gguf_file import CheckpointError
from engine.worker.loader import load_model
from tests.quant.gguf_models import tiny_llama, write_gguf

TIMEOUT_S = 5
TENSORS = ["token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight", "output_norm.weight"]
NUM_RANDOM, NUM_RANDOM_SLOW = 100, 3000


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))  # the metadata of every candidate


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> tuple[bytes, GGUFReader]:
    path = write_gguf(tiny_llama(), tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return path.read_bytes(), GGUFReader(path)


def put(data: bytes, at: int, fmt: str, value) -> bytes:
    return data[:at] + struct.pack("<" + fmt, value) + data[at + struct.calcsize("<" + fmt):]


def tensor_fields(reader: GGUFReader, name: str) -> dict[str, int]:
    """Byte offsets of a tensor table entry's fields: n_dims, dims (innermost first), type, offset."""
    t = next(t for t in reader.tensors if t.name == name)
    at = t.field.offset + 8 + len(name)
    n = len(t.shape)
    return {"n_dims": at, "dims": at + 4, "type": at + 4 + 8 * n, "offset": at + 8 + 8 * n}


def gguf_cases(data: bytes, reader: GGUFReader) -> list[tuple[str, bytes, str | None]]:
    """(name, mutated file, the tensor the error must name or None) for every structured mutation."""
    tokens = reader.fields["tokenizer.ggml.tokens"]
    types = reader.fields["tokenizer.ggml.token_type"]
    first_tensor = reader.tensors[0].field.offset
    data_start = min(t.data_offset for t in reader.tensors)
    cases = [(f"truncated at {n}", data[:n], None) for n in
             (0, 3, 6, 12, 20, tokens.offset + 30, first_tensor, first_tensor + 20, data_start, len(data) // 2 + 7,
              len(data) - 1)]
    cases += [("tensor count 2^63", put(data, 8, "Q", 2**63), None), ("tensor count 10^7", put(data, 8, "Q", 10**7), None),
              ("metadata count 2^63", put(data, 16, "Q", 2**63), None), ("metadata count 10^9", put(data, 16, "Q", 10**9), None),
              ("tokens count 2^62", put(data, tokens.offset + 8 + 21 + 8, "Q", 2**62), None),
              ("token types count 2^61", put(data, types.offset + 8 + 25 + 8, "Q", 2**61), None),
              ("key length 2^62", put(data, tokens.offset, "Q", 2**62), None),
              ("metadata type 99", put(data, tokens.offset + 8 + 21, "I", 99), None)]
    for name in TENSORS:
        f = tensor_fields(reader, name)
        t = next(t for t in reader.tensors if t.name == name)
        cases += [(f"{name} n_dims {n}", put(data, f["n_dims"], "I", n), None) for n in (0, 9, 2**31)]
        cases += [(f"{name} dim {d}", put(data, f["dims"], "Q", d), name) for d in (0, 2 * int(t.shape[0]), 2**62)]
        cases += [(f"{name} offset {o}", put(data, f["offset"], "Q", o), name) for o in (len(data), 2**63)]
        cases += [(f"{name} type {k}", put(data, f["type"], "I", k), name) for k in (999, 2**31)]
    return cases


def attempt(path: Path):
    """load_model on ``path`` under a timeout; returns the model, or the CheckpointError raised."""
    def hung(*_):
        raise TimeoutError(f"loading {path.name} took over {TIMEOUT_S} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, TIMEOUT_S)
    try:
        return load_model(path, torch.float32, torch.device("cpu"))
    except CheckpointError as e:
        return e
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def check_refused(path: Path, tensor: str | None) -> None:
    got = attempt(path)
    assert isinstance(got, CheckpointError), f"{path.name} loaded"
    assert str(path) in str(got) and (tensor is None or tensor in str(got)), str(got)


def test_every_structured_gguf_mutation_is_refused_by_name(gguf_bytes, tmp_path):
    data, reader = gguf_bytes
    cases = gguf_cases(data, reader)
    for i, (name, mutated, tensor) in enumerate(cases):
        path = tmp_path / f"case{i}.gguf"
        path.write_bytes(mutated)
        try:
            check_refused(path, tensor)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    assert len(cases) == 59


def random_mutations(data: bytes, reader: GGUFReader, n: int, seed: int):
    """Seeded random damage to the header (metadata and tensor table): byte flips, a 64-bit
    field overwritten with an extreme value, a cut."""
    rng = random.Random(seed)
    header = min(t.data_offset for t in reader.tensors)
    for _ in range(n):
        at = rng.randrange(4, header)
        kind = rng.choice(["flip", "word", "cut"])
        if kind == "flip":
            yield data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:]
        elif kind == "word":
            yield put(data, at, "Q", rng.choice([0, 2**32 - 1, 2**63 - 1, 2**64 - 1, rng.randrange(2**64)]))
        else:
            yield data[: rng.randrange(at, len(data))]


def run_random(gguf_bytes, tmp_path, n: int, seed: int) -> int:
    data, reader = gguf_bytes
    loaded = 0
    for i, mutated in enumerate(random_mutations(data, reader, n, seed)):
        path = tmp_path / f"random{i}.gguf"
        path.write_bytes(mutated)
        got = attempt(path)
        if isinstance(got, CheckpointError):
            assert str(path) in str(got), str(got)
        else:
            loaded += 1
    return loaded


def test_random_header_damage_loads_or_is_refused_by_name(gguf_bytes, tmp_path):
    assert run_random(gguf_bytes, tmp_path, NUM_RANDOM, seed=0) < NUM_RANDOM  # most damage is refused


@pytest.mark.slow
def test_much_random_header_damage_loads_or_is_refused_by_name(gguf_bytes, tmp_path):
    assert run_random(gguf_bytes, tmp_path, NUM_RANDOM_SLOW, seed=1) < NUM_RANDOM_SLOW


@pytest.fixture(scope="module")
def safetensors_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("st")
    tiny_llama().save_pretrained(out)
    return out


def header_of(data: bytes) -> dict:
    n = struct.unpack_from("<Q", data)[0]
    return json.loads(data[8 : 8 + n])


def with_header(data: bytes, header: dict) -> bytes:
    """The file with ``header`` in place of its own (the data section unchanged)."""
    n = struct.unpack_from("<Q", data)[0]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n:]


def safetensors_cases(data: bytes) -> list[tuple[str, bytes, str | None]]:
    header = header_of(data)
    name = "model.layers.0.self_attn.q_proj.weight"
    entry = header[name]
    def changed(**kw) -> dict:
        return {**header, name: {**entry, **kw}}

    begin, end = entry["data_offsets"]
    return [("truncated", data[: len(data) // 2], None), ("header only", data[:8], None), ("empty", b"", None),
            ("header length 2^63", put(data, 0, "Q", 2**63), None), ("header length 0", put(data, 0, "Q", 0), None),
            ("header not JSON", data[:8] + b"{" * 8 + data[16:], None),
            ("offsets past the end", with_header(data, changed(data_offsets=[begin, len(data) * 2])), None),
            ("dtype XX", with_header(data, changed(dtype="XX")), None),
            ("shape against offsets", with_header(data, changed(shape=[7, 3])), None),
            ("wrong dimensions", with_header(data, changed(shape=[entry["shape"][0] * entry["shape"][1]])), name),
            ("transposed", with_header(data, changed(shape=[entry["shape"][1] // 2, entry["shape"][0] * 2])), name)]


def test_every_safetensors_header_mutation_is_refused_by_name(safetensors_dir, tmp_path):
    file = next(safetensors_dir.glob("*.safetensors"))
    data = file.read_bytes()
    for i, (what, mutated, tensor) in enumerate(safetensors_cases(data)):
        model_dir = tmp_path / f"st{i}"
        model_dir.mkdir()
        (model_dir / "config.json").write_text((safetensors_dir / "config.json").read_text())
        (model_dir / file.name).write_bytes(mutated)
        got = attempt(model_dir)
        assert isinstance(got, CheckpointError), f"{what}: loaded"
        assert file.name in str(got) and (tensor is None or tensor in str(got)), f"{what}: {got}"
