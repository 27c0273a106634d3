"""Fixtures of the engine-core tests."""

import pytest

from engine.layers import cpu_kernels

AVX512_BUILD = cpu_kernels.load() is not None and cpu_kernels.compile_flags() != cpu_kernels.FLAGS


@pytest.fixture(params=["native", pytest.param("avx2", marks=pytest.mark.skipif(
    not AVX512_BUILD, reason="this CPU's build is the AVX2 one"))])
def kernel_build(request, monkeypatch):
    """The kernels of this CPU's build, and the AVX2-only build where this CPU has AVX-512."""
    if request.param == "avx2":
        lib = cpu_kernels.build(cpu_kernels.compiler(), cpu_kernels.FLAGS)
        monkeypatch.setattr(cpu_kernels, "load", lambda: lib)
    return request.param


def other_vendor_build():
    """The AVX-512 build of the other CPU vendor than this one (cpu_kernels.AMD: the matmul's
    few rows from 4 panels side by side, attention read ahead; or without): both run here."""
    flags = cpu_kernels.FLAGS + cpu_kernels.AVX512
    amd = set(cpu_kernels.AMD) <= set(cpu_kernels.compile_flags())
    return cpu_kernels.build(cpu_kernels.compiler(), flags if amd else flags + cpu_kernels.AMD)
