"""The C kernels under AddressSanitizer and UBSan: the kernel tests that reach every C entry
point (float32 and bfloat16-cache attention, rms_norm, rope, silu_mul, matmul, MoE, the
decoder layer, every quantized format's matmul and row lookup, the suffix index) run in a
subprocess whose libraries are built with ``SPECSERVE_CPU_SANITIZE=1``; no report may appear.
A power check first shows that the same settings report a heap overflow and a signed overflow."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.layers import cpu_kernels
from server.openmp import intel_openmp_path

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
REPORTS = ("ERROR: AddressSanitizer", "runtime error:")
# Python never frees some memory; a too-large malloc returns NULL as glibc's does (the kernels' out-of-memory path)
AVX2_ONLY = "this CPU's build is the AVX2 one"  # the only skip allowed: no second build to run (conftest)
ASAN_OPTIONS = "detect_leaks=0:allocator_may_return_null=1"
KERNEL_TESTS = [  # each C entry point at least once; about 5 minutes on 2 cores
    "tests/engine_core/test_cpu_kernels.py",
    "tests/engine_core/test_kv_cache_dtype.py::test_bf16_cache_gives_the_float32_kernels_bits_over_the_widened_values",
    "tests/engine_core/test_kv_cache_dtype.py::test_the_torch_backend_and_the_kernel_read_a_bf16_cache_alike",
    "tests/engine_core/test_softcap_listed.py",
    "tests/engine_core/test_kernel_errors.py",
    "tests/quant/test_kernels.py",
    "tests/quant/test_gguf_models.py::test_fused_quantized_layers_give_the_bits_of_the_layer_modules",
    "tests/spec/test_suffix.py::test_continuations_branch_and_are_scored_by_frequency",
    "tests/spec/test_suffix.py::test_global_tree_serves_other_requests_and_evicts_fifo",
    "tests/spec/test_suffix.py::test_greedy_output_equals_plain_decoding",
]


def sanitizer_env() -> dict[str, str]:
    """This process's environment with the sanitizer runtimes preloaded (libasan must come
    first), Intel's OpenMP after them where there is one, and the sanitized builds on."""
    cc = cpu_kernels.compiler()
    libs = [subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()
            for name in ("libasan.so", "libubsan.so")]
    if not all(Path(lib).is_absolute() and Path(lib).exists() for lib in libs):
        pytest.skip(f"{cc} has no sanitizer runtimes ({libs})")
    omp = intel_openmp_path()
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPECSERVE_CPU_SANITIZE="1", ASAN_OPTIONS=ASAN_OPTIONS,
               UBSAN_OPTIONS="print_stacktrace=1")
    env["LD_PRELOAD"] = ":".join([*libs, *([str(omp)] if omp else [])])
    return env


def run_sanitized(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    if cpu_kernels.load() is None:
        pytest.skip("no CPU kernels here (AVX2, a C compiler)")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=sanitizer_env(), capture_output=True, text=True,
                          timeout=timeout)


BUGGY_C = """
#include <stdlib.h>
int heap_overflow(int n) { int *a = malloc(n * sizeof(int)); a[n] = 1; int r = a[0]; free(a); return r; }
int signed_overflow(int a) { return a + 1; }
"""
CALL = """
import ctypes, sys
from pathlib import Path
from engine.layers import cpu_kernels
src = Path(sys.argv[1])
lib = ctypes.CDLL(str(cpu_kernels.compile_library("buggy", [src], cpu_kernels.compiler(), ("-O2", "-shared", "-fPIC"))))
print(getattr(lib, sys.argv[2])(int(sys.argv[3])))
"""


@pytest.mark.parametrize("call, report", [
    (("heap_overflow", "4"), "ERROR: AddressSanitizer: heap-buffer-overflow"),
    (("signed_overflow", str(2**31 - 1)), "runtime error: signed integer overflow"),
])
def test_power_the_harness_reports_a_heap_overflow_and_a_signed_overflow(tmp_path, call, report):
    """A C file built by ``compile_library`` under the test's settings, one bug per call:
    each is reported and fails its process (else the kernel run below could pass vacuously)."""
    src = tmp_path / "buggy.c"
    src.write_text(BUGGY_C)
    done = run_sanitized(["-c", textwrap.dedent(CALL), str(src), *call], timeout=300)
    assert done.returncode != 0 and report in done.stderr, done.stderr[-3000:]


def test_the_kernel_tests_pass_with_no_sanitizer_report():
    """``--capture=sys``: a report written to fd 2 reaches this test, not pytest's capture of a process that dies."""
    pytest_args = ["-q", "-x", "-rs", "-p", "no:cacheprovider", "--capture=sys", "-m", "not slow"]
    done = run_sanitized(["-m", "pytest", *pytest_args, *KERNEL_TESTS], timeout=1800)
    found = [line for line in done.stderr.splitlines() if any(r in line for r in REPORTS)]
    assert not found, done.stderr[-5000:]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED") and AVX2_ONLY not in line]
    assert " passed" in done.stdout and not skips, done.stdout[-3000:]
