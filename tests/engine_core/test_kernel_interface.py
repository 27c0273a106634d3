"""The C kernels' interface (engine/layers/csrc/specserve_kernels.h): each ctypes struct laid
out as its C twin, a header edit rebuilding the libraries, and the C files free of circles
(includes, and calls from file to file), with no C file included by another."""

import ctypes
import re
import shutil

import pytest

from engine.layers import cpu_kernels, quant
from tests.test_imports import cycles

needs_kernel = pytest.mark.skipif(cpu_kernels.load() is None, reason="no AVX2/FMA CPU or no C compiler")
TWINS = [(cpu_kernels.LayerArgs, "layer_t"), (cpu_kernels.StepArgs, "step_t"), (cpu_kernels.MoEArgs, "moe_t"),
         (quant._Matrix, "quant_matrix")]


@needs_kernel
@pytest.mark.parametrize("struct, name", TWINS, ids=[n for _, n in TWINS])
def test_each_ctypes_struct_has_the_layout_of_its_c_twin(struct, name):
    """Same size, each field at the same offset: a field added, dropped, moved or retyped on
    one side only fails here, not as a kernel reading the wrong address."""
    offset = cpu_kernels.load().kernel_struct_offset
    offset.argtypes, offset.restype = [ctypes.c_char_p, ctypes.c_char_p], ctypes.c_int64
    assert offset(name.encode(), None) == ctypes.sizeof(struct)
    for field, _ in struct._fields_:
        assert offset(name.encode(), field.encode()) == getattr(struct, field).offset, field
    assert offset(name.encode(), b"no_such_field") == -1


def test_a_header_edit_changes_the_libraries_cache_keys(tmp_path):
    csrc = shutil.copytree(cpu_kernels.CSRC, tmp_path / "csrc")
    builds = [("cpu_kernels", cpu_kernels.sources(csrc)), ("quant_kernels", [csrc / cpu_kernels.QUANT_SOURCE])]
    for header in ("specserve_kernels.h", "common.h", "attention_template.h"):
        before = [cpu_kernels.library_path(name, files, "cc", cpu_kernels.FLAGS) for name, files in builds]
        with open(csrc / header, "a") as f:
            f.write("\n")
        after = [cpu_kernels.library_path(name, files, "cc", cpu_kernels.FLAGS) for name, files in builds]
        assert all(a != b for a, b in zip(before, after)), header


def _code(path) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", "", path.read_text(), flags=re.S)


def test_the_c_files_include_headers_only_and_form_no_circle():
    """Includes: headers only, no cycle. Calls: file A -> file B where A calls a function that
    a header declares and B defines; no cycle either, so each file builds on the ones below it."""
    files = sorted(cpu_kernels.CSRC.glob("*.[ch]"))
    includes = {p.name: set(re.findall(r'#include "([^"]+)"', _code(p))) for p in files}
    assert not [(a, b) for a, bs in includes.items() for b in bs if not b.endswith(".h")]
    assert not cycles(includes)
    declared = {n for p in files if p.suffix == ".h" for n in re.findall(r"^\w[\w *]*?\b(\w+)\([^;{]*\);", _code(p), re.M)}
    defined = {n: p.name for p in files if p.suffix == ".c"
               for n in re.findall(r"^\w[\w *]*?\b(\w+)\([^;{]*\)\s*\{", _code(p), re.M) if n in declared}
    assert {"decoder_layer_f32", "moe_f32", "rms_norm_f32", "matmul_f32"} <= defined.keys()
    calls = {p.name: {defined[f] for f in re.findall(r"\b(\w+)\s*\(", _code(p)) if defined.get(f, p.name) != p.name}
             for p in files if p.suffix == ".c"}
    assert calls["layer.c"] >= {"moe.c", "ops.c", "matmul.c"}
    assert not cycles(calls), cycles(calls)
