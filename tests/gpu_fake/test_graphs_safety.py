"""The captured region is graph-safe, checked on the CPU: capturing the bucketed forward on
fake CUDA (``tests.gpu_fake.fake_graphs``) fails on a host sync, a synchronize, a host-to-device
copy or a data-dependent shape inside it. It passes for the model as it is, through the
torch_varlen and the flash_attn backends (flash-attn's own interface over its stand-in),
and fails for each mutation that adds one of those to the model's forward."""

import pytest
import torch

from engine.worker.cuda_graphs import BucketedForward
from engine.models.decoder import LlamaForCausalLM
from kvcache.tensors import KVSpec, PagedKV
from tests.gpu_fake.engines import cuda_model
from tests.gpu_fake.fake_cuda import fake_cuda
from tests.gpu_fake.fake_graphs import GraphUnsafe
from tests.gpu_fake.flash_attn_sdist import real_flash_attn


def capture(backend: str) -> BucketedForward:
    block = 256 if backend == "flash_attn" else 16
    kv = PagedKV(KVSpec(2, 2, 16, block, torch.bfloat16), 4, "cuda", pad_block=True)
    graphs = BucketedForward(cuda_model(), backend, kv, 512, "cuda", max_requests=2, max_tokens=3, graphs=True)
    graphs.capture_all()
    return graphs


@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn"])
def test_the_bucketed_forward_captures(backend):
    with fake_cuda() as gpu, real_flash_attn():
        graphs = capture(backend)
        assert len(gpu.graphs) == len(graphs.buckets) == 6 and all(g.ops for g in gpu.graphs)


MUTATIONS = {
    "item": (lambda h: h.sum().item(), "host sync"),
    "tolist": (lambda h: h[0, :2].tolist(), "host sync"),
    "bool": (lambda h: bool((h > 0).any()), "host sync"),
    "to-host": (lambda h: h.cpu(), "device-to-host"),
    "nonzero": (lambda h: h.nonzero(), "data-dependent shape"),
    "new-host-data": (lambda h: h + torch.tensor([1.0], device=h.device, dtype=h.dtype), "host-to-device"),
    "synchronize": (lambda h: torch.cuda.synchronize(), "synchronize"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_capture_catches_a_mutated_forward(mutation, monkeypatch):
    extra, message = MUTATIONS[mutation]
    original = LlamaForCausalLM.forward

    def forward(self, *args, **kwargs):
        hidden = original(self, *args, **kwargs)
        extra(hidden)
        return hidden

    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)
    with fake_cuda(), pytest.raises(GraphUnsafe, match=message):
        capture("torch_varlen")
