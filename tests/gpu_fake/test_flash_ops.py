"""flash-attn's fused kernels on the flash_attn backend (``engine.layers.flash_ops``, and
``flash_attn_with_kvcache`` for steps of chains of one length), through flash-attn 2.8.3's
own Python files over the stand-ins (``flash_ops_standin``, ``flash_attn_standin``): each
agrees with the torch path it replaces; wrong calls fail; the engine's greedy tokens, eager
and replayed from CUDA graphs, are those of the unfused layers."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from bench.attention_problems import make_problem
from engine.attention import SeqSpec, paged_attention
from engine.attention.backends import FLASH_ATTN
from engine.attention.varlen_backend import kvcache_attention
from engine.config import SpeculativeConfig
from engine.layers import flash_ops
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models import decoder
from engine.sampling_params import SamplingParams
from engine.worker.cuda_graphs import BucketedForward
from kvcache.tensors import KVSpec, PagedKV
from tests.gpu_fake import flash_attn_standin, flash_ops_standin
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
            flash_attn_standin.calls.clear()
            engine = cuda_engine(cuda_model(echo=echo), CHAINS, backend="flash_attn", enforce_eager=eager, max_num_seqs=4)
            reqs, drafted = run(engine, params)
            tokens[fused] = [r.output_token_ids for r in reqs]
            launches[fused] = (len(flash_ops_standin.launches), sum("kvcache" in c for c in flash_attn_standin.calls))
            assert drafted > 0 or not echo
    assert tokens[True] == tokens[False]
    assert min(launches[True]) > 0 and launches[False] == (0, 0)  # the fused kernels; decodes in one kvcache call


def test_replay_reruns_the_fused_kernels():
    """flash_attn buckets captured with the fused kernels (decodes: one kvcache call a layer),
    replayed: each step gives what the same bucketed forward gives eagerly, bitwise, and what
    the unpadded step gives."""
    with fake_cuda(), real_flash_attn():
        model = cuda_model()
        kv = PagedKV(KVSpec(2, 2, 16, 256, torch.bfloat16), 4, "cuda", pad_block=True)
        graphs = BucketedForward(model, "flash_attn", kv, 512, "cuda", max_requests=2, max_tokens=2, graphs=True)
        graphs.capture_all()
        eager = BucketedForward(model, "flash_attn", kv, 512, "cuda", max_requests=2, max_tokens=2, graphs=False)
        steps = [([SeqSpec(5, 2, [1, 2])], [7, 8]), ([SeqSpec(20, 1, [1, 2]), SeqSpec(300, 1, [3, 0])], [3, 9])]
        for specs, ids in steps:
            bucket = graphs.bucket_for(specs)
            replayed = value(graphs.forward(bucket, specs, np.array(ids))).clone()
            assert torch.equal(replayed, value(eager.forward(bucket, specs, np.array(ids))))
            positions = torch.tensor([s.context_len + i for s in specs for i in range(s.query_len)], device="cuda")
            meta = FLASH_ATTN.build_metadata(specs, 256, "cuda")
            assert meta.kvcache is not None and graphs.buffers[bucket].kvcache == (bucket.tokens == 1)
            unpadded = model(torch.tensor(ids, device="cuda"), positions, meta, kv)
            close(replayed, unpadded)


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


@pytest.mark.parametrize("cases", [[(300, 1, None), (23, 1, None), (0, 1, None)], [(7, 3, None), (40, 3, None)]],
                         ids=["decodes", "chains"])
@pytest.mark.parametrize("kw", [{}, dict(window=5, scale=0.2, softcap=3.0)], ids=["plain", "window-softcap"])
def test_kvcache_call_matches_rope_then_varlen(ops, cases, kw):
    """Chains of one length through ``flash_attn_with_kvcache`` (rope, append, attend in one
    call): with an identity rope, the float64 reference; with Llama's rope, torch's rope then
    the varlen call, caches included."""
    pb = make_problem(cases, block_size=256, dtype=torch.bfloat16, device="cuda", num_heads=4, num_kv_heads=2,
                      head_dim=16, **kw)
    meta = FLASH_ATTN.build_metadata(pb.specs, 256, "cuda")
    step, layer_kw = meta.kvcache, dict(window=kw.get("window"), scale=kw.get("scale"), softcap=kw.get("softcap"))
    rows = step.block_table.shape[1] * 256  # the cache's reach
    identity = (torch.ones(rows, 8, device="cuda", dtype=torch.bfloat16),
                torch.zeros(rows, 8, device="cuda", dtype=torch.bfloat16))
    caches = (pb.k_cache.clone(), pb.v_cache.clone())
    out = kvcache_attention(pb.q, pb.k, pb.v, caches, step, *identity, **layer_kw)
    torch.testing.assert_close(value(out).double(), pb.reference, atol=BF16_TOL, rtol=BF16_TOL)
    rotary = RotaryEmbedding(LlamaConfig(**TINY), 16, 512).to("cuda")
    positions = torch.tensor([c + i for c, m, _ in cases for i in range(m)], device="cuda")
    fused_caches = (pb.k_cache.clone(), pb.v_cache.clone())
    fused = kvcache_attention(pb.q, pb.k, pb.v, fused_caches, step, *rotary.half_table(torch.bfloat16, rows), **layer_kw)
    qk = apply_rotary(torch.cat([pb.q, pb.k], 1), *rotary(positions, torch.bfloat16))
    unfused = paged_attention(qk[:, :4], qk[:, 4:], pb.v, (pb.k_cache, pb.v_cache), meta, **layer_kw)
    close(fused, unfused)
    for a, b in zip(fused_caches, (pb.k_cache, pb.v_cache)):
        close(a, b)
