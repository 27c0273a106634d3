"""flash-attn's fused kernels on the flash_attn backend (``engine.layers.flash_ops``), through
flash-attn 2.8.3's own Python files over the kernel stand-ins (``flash_ops_standin``): each
agrees with the torch path it replaces; wrong calls fail; the engine's greedy tokens, eager
and replayed from CUDA graphs, are those of the unfused layers."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from engine.attention import SeqSpec
from engine.config import SpeculativeConfig
from engine.layers import flash_ops
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models import decoder
from engine.sampling_params import SamplingParams
from engine.worker.cuda_graphs import BucketedForward
from kvcache.tensors import KVSpec, PagedKV
from tests.gpu_fake import flash_ops_standin
from tests.gpu_fake.engines import TINY, cuda_engine, cuda_model, run
from tests.gpu_fake.fake_cuda import fake_cuda, value
from tests.gpu_fake.fake_graphs import GraphUnsafe
from tests.gpu_fake.flash_attn_sdist import real_flash_attn

BF16_TOL = 3e-2


@pytest.fixture
def ops():
    with fake_cuda(), real_flash_attn():
        loaded = flash_ops.load()
        assert loaded is not None
        flash_ops_standin.launches.clear()
        yield loaded


def close(fused, reference) -> None:
    torch.testing.assert_close(value(fused).float(), value(reference).float(), atol=BF16_TOL, rtol=BF16_TOL)


def test_add_and_rms_norm_match_the_torch_path(ops):
    x, residual = torch.randn(2, 5, 64, device="cuda", dtype=torch.bfloat16).unbind(0)
    norm = RMSNorm(64, 1e-5).to(device="cuda", dtype=torch.bfloat16)
    norm.weight.data = torch.rand(64, device="cuda", dtype=torch.bfloat16) + 0.5
    close(norm.flash(ops.rms_norm_fn, x), norm(x))
    normed, summed = norm.flash(ops.rms_norm_fn, x, residual)
    assert summed.dtype == torch.bfloat16 and normed.shape == x.shape
    close(summed, x + residual)
    close(normed, norm(x + residual))
    assert flash_ops_standin.launches == ["_layer_norm_fwd_1pass_kernel"] * 2


def test_rotary_matches_the_torch_path_at_any_positions(ops):
    """Queries and keys side by side [T, heads, D], a strided view as the model passes them,
    at positions in any order (a step's requests), against the torch rope."""
    rotary = RotaryEmbedding(LlamaConfig(**TINY), 16, 256).to("cuda")
    qkv = torch.randn(6, 8, 16, device="cuda", dtype=torch.bfloat16)
    qk = qkv[:, :6]  # [T, 6, 16], rows 8 heads apart
    positions = torch.tensor([40, 3, 4, 5, 200, 0], device="cuda")
    fused = ops.apply_rotary(qk.unsqueeze(0), *rotary.halves(positions))[0]
    close(fused, apply_rotary(qk, *rotary(positions, torch.bfloat16)))
    assert flash_ops_standin.launches == ["rotary_kernel"]


def test_swiglu_matches_the_torch_path(ops):
    gate, up = torch.randn(5, 2 * 32, device="cuda", dtype=torch.bfloat16).chunk(2, dim=-1)
    close(ops.swiglu(gate, up), torch.nn.functional.silu(gate) * up)


def test_wrong_calls_fail(ops):
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(AssertionError):  # flash-attn's own check: residual of x's shape
        ops.rms_norm_fn(x, w, None, residual=x[:2], prenorm=True)
    with pytest.raises(AssertionError):  # the weight must have x's features
        ops.rms_norm_fn(x, w[:32], None)
    cos = torch.rand(3, 8, device="cuda")
    with pytest.raises(AssertionError, match="seqlen_ro must be >= seqlen"):  # a table shorter than the step
        ops.apply_rotary(x.view(1, 4, 4, 16), cos, cos)
    with pytest.raises(RuntimeError, match="cannot be accessed from Triton"):  # CPU tensors
        ops.apply_rotary(torch.randn(1, 3, 4, 16), cos.cpu(), cos.cpu())
    with pytest.raises(RuntimeError, match="operands must match"):
        ops.swiglu(x, x[:2])


CHAINS = SpeculativeConfig(method="ngram", num_speculative_tokens=3, verify_cost=0.05)


@pytest.mark.parametrize(("echo", "eager"), [(False, True), (True, False)], ids=["random-eager", "echo-graphs"])
def test_engine_tokens_are_the_unfused_ones(echo, eager, monkeypatch):
    """Greedy decoding on the flash_attn backend, fused and not: random weights (tokens that
    any wrong kernel changes), and the echo model whose drafts verify chains, on CUDA graphs."""
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)] * 2
    tokens, launches = {}, {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(decoder.flash_ops, "load", lambda: None)
        with fake_cuda(), real_flash_attn():
            flash_ops_standin.launches.clear()
            engine = cuda_engine(cuda_model(echo=echo), CHAINS, backend="flash_attn", enforce_eager=eager, max_num_seqs=4)
            reqs, drafted = run(engine, params)
            tokens[fused], launches[fused] = [r.output_token_ids for r in reqs], len(flash_ops_standin.launches)
            assert drafted > 0 or not echo
    assert tokens[True] == tokens[False]
    assert launches[True] > 0 and launches[False] == 0


def test_replay_reruns_the_fused_kernels():
    """A flash_attn bucket captured with the fused kernels, replayed for two steps: each gives
    what the same bucketed forward gives eagerly, bitwise."""
    with fake_cuda(), real_flash_attn():
        model = cuda_model()
        kv = PagedKV(KVSpec(2, 2, 16, 256, torch.bfloat16), 4, "cuda", pad_block=True)
        graphs = BucketedForward(model, "flash_attn", kv, 512, "cuda", max_requests=2, max_tokens=2, graphs=True)
        graphs.capture_all()
        eager = BucketedForward(model, "flash_attn", kv, 512, "cuda", max_requests=2, max_tokens=2, graphs=False)
        for ctx, ids in ((5, [7, 8]), (20, [3, 9])):
            specs = [SeqSpec(ctx, 2, [1, 2])]
            bucket = graphs.bucket_for(specs)
            replayed = value(graphs.forward(bucket, specs, np.array(ids))).clone()
            assert torch.equal(replayed, value(eager.forward(bucket, specs, np.array(ids))))


def test_a_kernel_compiled_inside_a_capture_is_caught(ops):
    """Triton compiles a kernel on its first launch of a specialization: inside a CUDA graph
    capture that fails on a GPU, and under the harness; run eagerly first, it captures."""
    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)  # one row: a specialization of its own
    w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(GraphUnsafe, match="compiles _layer_norm_fwd_1pass_kernel"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            ops.rms_norm_fn(x, w, None)
    ops.rms_norm_fn(x, w, None)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        ops.rms_norm_fn(x, w, None)
