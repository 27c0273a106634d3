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


def other_streams_build():
    """The AVX-512 build with the other matmul stream count than this CPU's build (4 panels
    side by side where it reads 1, 1 where it reads 4): both paths run on an AVX-512 CPU."""
    flags = cpu_kernels.FLAGS + cpu_kernels.AVX512
    native = set(cpu_kernels.compile_flags())
    return cpu_kernels.build(cpu_kernels.compiler(), flags if set(cpu_kernels.STREAMS) <= native else flags + cpu_kernels.STREAMS)
