"""The fake-CUDA harness itself: it must raise where CUDA raises, count what CUDA would
stall for, and keep the values right, or the tests built on it prove nothing."""

import pytest
import torch

from tests.gpu_fake.fake_cuda import fake_cuda, value


def test_device_mixing_raises_as_on_cuda():
    with fake_cuda():
        x = torch.ones(4, 3, device="cuda")
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(3)
        with pytest.raises(RuntimeError, match="same device"):
            x.gather(1, torch.zeros(4, 1, dtype=torch.long))  # gather takes no CPU index on CUDA
        with pytest.raises(RuntimeError, match="same device"):
            torch.ones(3).index_select(0, torch.zeros(1, dtype=torch.long, device="cuda"))
        assert (x * torch.tensor(2.0)).device.type == "cuda"  # a CPU scalar mixes
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()


def test_cpu_index_tensors_index_cuda_tensors_through_a_blocking_copy():
    with fake_cuda() as gpu:
        x = torch.arange(12.0, device="cuda").view(4, 3)
        rows = x[torch.tensor([3, 0])]
        assert rows.device.type == "cuda" and value(rows).tolist() == [[9, 10, 11], [0, 1, 2]]
        assert gpu.counts.h2d_blocking == 1
        x[torch.tensor([1])] = 0.0
        assert value(x)[1].tolist() == [0, 0, 0]
        with pytest.raises(RuntimeError, match="indices should be either on cpu"):
            torch.ones(3)[torch.tensor([0], device="cuda")]


def test_values_follow_the_ops_and_reads_count_as_syncs():
    with fake_cuda() as gpu:
        x = torch.arange(6, device="cuda").view(2, 3)
        x[:, 1:] *= 10  # a view written in place: the base sees it
        assert gpu.counts.num_syncs == 0
        assert x.sum(1).tolist() == [30, 93]
        assert gpu.counts.syncs[".tolist()"] == 1
        assert x[1, 2].item() == 50 and bool(x.any())
        assert gpu.counts.num_syncs == 3
        host = x.cpu()
        assert type(host) is torch.Tensor and host.tolist() == [[0, 10, 20], [3, 40, 50]]
        assert gpu.counts.syncs["device-to-host copy"] == 1
        x.nonzero()
        assert gpu.counts.syncs["data-dependent shape (nonzero.default)"] == 1


def test_host_to_device_copies_are_asynchronous_only_from_pinned_memory():
    with fake_cuda() as gpu:
        pinned, pageable = torch.arange(4.0, pin_memory=True), torch.arange(4.0)
        assert pinned.is_pinned() and not pageable.is_pinned()
        dst = torch.empty(4, device="cuda")
        dst.copy_(pinned, non_blocking=True)
        pinned[1:].to("cuda", non_blocking=True)  # a view of a pinned buffer is pinned
        assert (gpu.counts.h2d_async, gpu.counts.h2d_blocking) == (2, 0)
        dst.copy_(pageable, non_blocking=True)
        pinned.to("cuda")  # pinned, but blocking
        assert (gpu.counts.h2d_async, gpu.counts.h2d_blocking) == (2, 2)
        assert value(dst).tolist() == [0, 1, 2, 3]


def test_memory_is_what_live_cuda_tensors_hold():
    with fake_cuda(total_bytes=1 << 30):
        x = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
        assert torch.cuda.memory_allocated() == 2 << 20
        view = x[: 1 << 10]  # no new storage
        assert torch.cuda.memory_allocated() == 2 << 20
        y = x.float()
        assert torch.cuda.max_memory_allocated() == 6 << 20
        del x, y
        assert torch.cuda.memory_allocated() == 2 << 20  # the view keeps its base alive
        del view
        assert torch.cuda.memory_allocated() == 0 and torch.cuda.max_memory_allocated() == 6 << 20
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == 0
        assert torch.cuda.mem_get_info() == (1 << 30, 1 << 30)


def test_parameter_data_reassignment_moves_the_values_and_the_bytes():
    with fake_cuda() as gpu:
        with torch.device("cuda"):
            p = torch.nn.Parameter(torch.ones(1024), requires_grad=False)
        assert gpu.allocated == 4096
        p.data = p.data.to(torch.bfloat16)
        assert p.dtype == torch.bfloat16 and value(p).dtype == torch.bfloat16
        assert gpu.allocated == 2048 and (p * 2).sum().item() == 2048


def test_generators_must_be_on_their_tensors_device():
    with fake_cuda():
        x = torch.empty(1000, device="cuda")
        g = torch.Generator("cuda").manual_seed(7)
        a = value(x.exponential_(generator=g)).clone()
        g.manual_seed(7)
        assert torch.equal(value(x.exponential_(generator=g)), a)
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator"):
            x.exponential_(generator=torch.Generator().manual_seed(0))
        with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator"):
            torch.empty(3).exponential_(generator=torch.Generator("cuda"))


def test_cuda_functions_are_patched_only_inside():
    with fake_cuda(device_count=2) as gpu:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 2
        torch.cuda.synchronize()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        assert gpu.counts.synchronize == 2
    assert not torch.cuda.is_available()


def test_strict_mode_runs_torch_fake_kernels_with_the_same_results():
    with fake_cuda(strict=True):
        x = torch.randn(5, 8, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(8, 8, device="cuda", dtype=torch.bfloat16)
        out = torch.nn.functional.linear(x, w).float().softmax(-1)
        torch.testing.assert_close(value(out), torch.nn.functional.linear(value(x), value(w)).float().softmax(-1))
        with pytest.raises(RuntimeError):
            x @ torch.randn(7, 3, device="cuda", dtype=torch.bfloat16)
