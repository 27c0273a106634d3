"""Which device, attention backend and GPUs the engine takes, and that it says why."""

import warnings

import numpy as np
import pytest
import torch
import yaml

from engine.attention import SeqSpec
from engine.attention.backends import TORCH_VARLEN, select_backend
from engine.attention.varlen_metadata import VarlenMetadata
from engine.config import ModelConfig
from engine.utils.devices import choose_device
from tests.deploy.conftest import ROOT
from tests.gpu_fake.fake_cuda import fake_cuda


def unusable_cuda_build(monkeypatch, message="CUDA driver version is insufficient for CUDA runtime version"):
    """A CUDA 13 torch on a node whose driver is too old: is_available() warns and says no."""
    def is_available():
        warnings.warn(message)
        return False

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", is_available)


def test_auto_says_what_it_chose_and_why(monkeypatch):
    choice = choose_device("auto")
    assert choice.device.type == "cpu" and "CPU build" in choice.reason and not choice.fell_back
    with fake_cuda():
        choice = choose_device("auto")
        assert choice.device.type == "cuda" and "H200" in choice.reason
    unusable_cuda_build(monkeypatch)
    choice = choose_device("auto")
    assert choice.device.type == "cpu" and choice.fell_back and "driver version is insufficient" in choice.reason


def test_device_cuda_fails_the_start_when_cuda_is_unusable(monkeypatch):
    """A GPU deployment passes --device cuda: without a usable GPU it must not start (its
    readiness probe then never passes) rather than serve on the CPU."""
    unusable_cuda_build(monkeypatch)
    with pytest.raises(ValueError, match="CUDA cannot be used: .*driver version is insufficient"):
        ModelConfig(device="cuda").torch_device()
    with fake_cuda(device_count=2):
        assert ModelConfig(device="cuda:1").torch_device() == torch.device("cuda:1")
        with pytest.raises(ValueError, match="only 2 CUDA devices"):
            ModelConfig(device="cuda:2").torch_device()


def test_gpu_deployments_ask_for_cuda():
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    k8s = yaml.safe_load((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())
    (container,) = k8s["spec"]["template"]["spec"]["containers"]
    replicas = [svc["command"] for name, svc in compose["services"].items() if name.startswith("specserve")]
    assert replicas
    for args in (*replicas, container["args"]):
        assert args[args.index("--device") + 1] == "cuda"


def test_a_flash_attn_that_does_not_load_is_not_chosen(tmp_path, monkeypatch):
    """An installed wheel built for another torch fails at import: auto takes torch_varlen."""
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with fake_cuda():
        assert select_backend("auto", torch.device("cuda"), torch.bfloat16).name == "torch_varlen"
        with pytest.raises(ValueError, match="does not load .*undefined symbol"):
            select_backend("flash_attn", torch.device("cuda"), torch.bfloat16)


def test_flash_attn_needs_a_head_dim_its_kernels_take(monkeypatch):
    from engine.attention import backends

    monkeypatch.setattr(backends, "flash_attn_status", lambda: None)
    with fake_cuda():
        assert select_backend("auto", torch.device("cuda"), torch.bfloat16, head_dim=128).name == "flash_attn"
        assert select_backend("auto", torch.device("cuda"), torch.bfloat16, head_dim=100).name == "torch_varlen"


def test_tensor_parallel_ranks_take_one_gpu_each_from_the_first():
    from engine.distributed.messages import Rendezvous
    from engine.distributed.model import check_parallel
    from engine.distributed.worker import rank_device
    from tests.gpu_fake.engines import TINY
    from transformers import LlamaConfig

    def device(rank0: str, rank: int, local_rank: int) -> str:
        return str(rank_device(rank0, Rendezvous(rank, local_rank, 4, "127.0.0.1", 1, 1.0)))

    assert [device("cuda:1", r, r) for r in (1, 2)] == ["cuda:2", "cuda:3"]
    assert device("cuda", 1, 1) == "cuda:1" and device("cpu", 1, 1) == "cpu"
    assert [device("cuda:1", r, r - 2) for r in (2, 3)] == ["cuda:0", "cuda:1"]  # node 1 counts from cuda:0
    config = LlamaConfig(**TINY)
    with fake_cuda(device_count=2):
        check_parallel(config, 2, torch.device("cuda:0"))
        with pytest.raises(ValueError, match="from cuda:1: only 2 CUDA devices"):
            check_parallel(config, 2, torch.device("cuda:1"))


def test_workers_attend_with_rank_0s_backend():
    """A worker builds its metadata with the backend rank 0 chose, not always the torch one."""
    from engine.distributed.messages import AllocateKV, ForwardStep, Shutdown
    from engine.distributed.worker import _serve

    seen = []

    class Shard(torch.nn.Module):
        layers = [type("L", (), {"self_attn": type("A", (), {"num_kv_heads": 2, "head_dim": 8})()})()]

        def forward(self, ids, positions, meta, kv, num_layers=None):
            seen.append(type(meta))

        def parameters(self):
            yield torch.zeros(1)

    class Messages:  # rank 0's channel, as the worker reads it
        def __init__(self, *msgs):
            self.msgs = list(msgs)

        def recv(self):
            return self.msgs.pop(0)

    channel = Messages(AllocateKV(4, 16, "float32"), ForwardStep(np.array([1, 2]), np.array([0, 1]), [SeqSpec(0, 2, [0])], None),
                       Shutdown())
    assert _serve(channel, Shard(), torch.device("cpu"), TORCH_VARLEN.build_metadata)
    assert seen == [VarlenMetadata]
