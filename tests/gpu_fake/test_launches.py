"""CUDA kernels per Llama decoder layer in one decode step on fake CUDA, counted (not timed):
every dispatched op on CUDA tensors that launches a kernel (``fake_graphs.kernels``), the
difference between a 3-layer and a 1-layer model over 2. The bounds are today's counts:
a change that adds launches to the decode step fails here (docs/gpu.md, "Launches").
flash-attn's fused kernels (``engine.layers.flash_ops``, ``flash_attn_with_kvcache``)
count one each (``flash_ops_standin``, ``flash_attn_standin``)."""

import pytest
import torch

from engine.attention import SeqSpec
from engine.attention.backends import FLASH_ATTN, TORCH_VARLEN
from kvcache.tensors import KVSpec, PagedKV
from tests.gpu_fake.engines import cuda_model
from tests.gpu_fake.fake_cuda import fake_cuda
from tests.gpu_fake.fake_graphs import kernels
from tests.gpu_fake.flash_attn_sdist import real_flash_attn

# backend -> kernels per decoder layer (today's)
BOUNDS = {"flash_attn": 9, "torch_varlen": 80}


def decode_kernels(layers: int, backend):
    block = 256 if backend is FLASH_ATTN else 16
    model = cuda_model(num_hidden_layers=layers)
    kv = PagedKV(KVSpec(layers, 2, 16, block, torch.bfloat16), 4, "cuda")
    specs = [SeqSpec(10, 1, [0, 1]), SeqSpec(20, 1, [2, 3])]  # two decodes
    meta = backend.build_metadata(specs, block, "cuda")
    ids, pos = torch.tensor([3, 4], device="cuda"), torch.tensor([10, 20], device="cuda")
    with kernels() as counts:
        model(ids, pos, meta, kv)
    return counts


@pytest.mark.parametrize("backend", [FLASH_ATTN, TORCH_VARLEN], ids=lambda b: b.name)
def test_kernels_per_decoder_layer(backend):
    with fake_cuda(), real_flash_attn():
        one, three = decode_kernels(1, backend), decode_kernels(3, backend)
    per_layer = (three - one).total() / 2
    assert per_layer <= BOUNDS[backend.name], sorted((three - one).items(), key=lambda kv: -kv[1])
    assert (three - one)["aten::mm"] == 2 * 4  # qkv, o, gate_up, down: the matmuls are not the excess
    if backend is FLASH_ATTN:
        assert (three - one)["flash_attn_standin::fwd_kvcache"] == 2  # rope, KV write and attention: one call
        assert (three - one)["flash_attn::layer_norm_fwd_impl"] == 2 * 2  # the norm; the add and the norm
        assert (three - one)["fake_cuda::launch"] == 2  # SiLU * up
