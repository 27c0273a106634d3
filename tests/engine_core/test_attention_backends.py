"""The attention backends on the CPU: the log-sum-exp merge, the varlen layout,
the tree split of the flash path (with the flash call replaced by a reference
kernel that returns its log-sum-exp), the torch_varlen CUDA fallback, and the
flash-attn adapter against a stand-in module. Everything CUDA is in tests/gpu."""

import sys
import types

import pytest
import torch

from engine.attention import SeqSpec, build_attention_metadata, paged_attention, select_backend
from engine.attention import torch_backend
from engine.attention.backends import CPU, FLASH_ATTN, TORCH, TORCH_VARLEN
from engine.layers import cpu_kernels
from engine.attention.lse import masked_attention_lse, merge_attention
from engine.attention.varlen_backend import flash_kernel, torch_kernel
from engine.attention.varlen_metadata import VarlenGroup, build_varlen_metadata
from bench.attention_problems import CASES, make_problem, reference_kernel


def dense_with_lse(q, k, v, visible):
    """q [N, H, D], k and v [N, K, H, D], visible [N, K] -> float64 out [N, H, D], lse [N, H]."""
    s = torch.einsum("nhd,nkhd->nhk", q.double(), k.double()) * q.shape[-1] ** -0.5
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("nhk,nkhd->nhd", torch.softmax(s, -1).nan_to_num(0.0), v.double()), lse


def test_merge_of_two_key_sets_is_attention_over_their_union():
    gen = torch.Generator().manual_seed(0)
    n, num_keys, h, d = 6, 10, 3, 8
    q, k, v = (torch.randn(*shape, generator=gen) for shape in [(n, h, d), (n, num_keys, h, d), (n, num_keys, h, d)])
    in_a = torch.rand(n, num_keys, generator=gen) < 0.5
    in_a[0] = False  # row 0: part A sees nothing (lse -inf, weight 0)
    in_a[1] = True  # row 1: part B sees nothing... but B must see a key: give it the last one
    in_a[1, -1] = False
    out_a, lse_a = dense_with_lse(q, k, v, in_a)
    out_b, lse_b = dense_with_lse(q, k, v, ~in_a)
    out, lse = merge_attention(out_a.float(), lse_a.float(), out_b.float(), lse_b.float())
    full, full_lse = dense_with_lse(q, k, v, torch.ones_like(in_a))
    torch.testing.assert_close(out.double(), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), full_lse, atol=1e-5, rtol=1e-5)
    # The test can fail: weighting the parts by key counts instead of their lse is wrong.
    share = in_a.sum(1, keepdim=True)[:, :, None] / num_keys
    assert not torch.allclose((out_a * share + out_b * (1 - share)).float(), full.float(), atol=1e-2)


def test_masked_attention_lse_with_grouped_heads_and_an_empty_row():
    gen = torch.Generator().manual_seed(1)
    n, mq, mk, h, kvh, d = 2, 3, 5, 4, 2, 8
    q = torch.randn(n, mq, h, d, generator=gen)
    k, v = torch.randn(n, mk, kvh, d, generator=gen), torch.randn(n, mk, kvh, d, generator=gen)
    mask = torch.rand(n, mq, mk, generator=gen) < 0.6
    mask[0, 0] = False  # sees nothing
    mask[1, 2] = True
    out, lse = masked_attention_lse(q, k, v, mask, d**-0.5)
    expand = lambda t: t.repeat_interleave(h // kvh, dim=2)  # noqa: E731  head h reads KV head h // group
    for b in range(n):
        keys, values = (expand(t)[b][None].expand(mq, -1, -1, -1) for t in (k, v))
        ref, ref_lse = dense_with_lse(q[b], keys, values, mask[b])
        torch.testing.assert_close(out[b].double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b].double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert (out[0, 0] == 0).all() and (lse[0, 0] == float("-inf")).all()


def test_varlen_metadata_worked_example():
    # The example of engine.attention.varlen_metadata's docstring, plus a tree.
    specs = [SeqSpec(3, 2, [1, 0]), SeqSpec(4, 1, [2, 9]), SeqSpec(2, 3, [5, 6], (-1, 0, 0))]
    meta = build_varlen_metadata(specs, block_size=4, device="cpu", kernel=torch_kernel)
    (g,) = meta.groups
    assert g.cu_seqlens_q.tolist() == [0, 2, 3] and g.cu_seqlens_k.tolist() == [0, 5, 10]
    assert g.block_table.tolist() == [[1, 0], [2, 9]] and g.block_table.dtype == torch.int32
    assert (g.max_seqlen_q, g.max_seqlen_k, g.causal) == (2, 5, True) and g.token_index.tolist() == [0, 1, 2]
    (p,) = meta.tree_prefixes  # the tree's nodes against its 2 committed tokens only, not causal
    assert p.cu_seqlens_q.tolist() == [0, 3] and p.cu_seqlens_k.tolist() == [0, 2] and not p.causal
    assert p.block_table.tolist() == [[5]] and meta.tree.valid_tokens.tolist() == [3, 4, 5]
    assert meta.slot_mapping.tolist() == [7, 0, 36, 22, 23, 24]
    alone = build_varlen_metadata(specs[:2], block_size=4, device="cpu", kernel=torch_kernel)
    assert alone.groups[0].token_index is None and alone.tree is None  # every token, in order


def test_torch_kernel_is_bottom_right_causal_like_flash_attn():
    # flash-attn's docstring: seqlen_q 2, seqlen_k 5 -> rows see 4 and 5 keys;
    # seqlen_q 5, seqlen_k 2 -> the first three rows see nothing (output 0).
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = torch.randn(4, 4, 1, 8, generator=gen), torch.randn(4, 4, 1, 8, generator=gen)
    q = torch.randn(7, 2, 8, generator=gen)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    g = VarlenGroup(None, i32([0, 2, 7]), i32([0, 5, 7]), 5, 5, i32([[3, 1], [2, 0]]), causal=True)
    out, lse = torch_kernel(q, k_cache, v_cache, g, 8**-0.5)
    ref, ref_lse = reference_kernel(q, k_cache, v_cache, g, 8**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert (out[2:5] == 0).all() and (lse[2:5] == float("-inf")).all() and lse[5:].isfinite().all()


def fresh(problem):
    return problem.k_cache.clone(), problem.v_cache.clone()


@pytest.mark.parametrize("contiguous", [False, True], ids=["scattered-blocks", "contiguous-blocks"])
@pytest.mark.parametrize(
    "kernel, split", [(reference_kernel, False), (torch_kernel, False), (torch_kernel, True)],
    ids=["flash-path-with-reference-kernel", "flash-path-with-torch-kernel", "torch_varlen"],
)
def test_varlen_backend_matches_the_torch_reference(kernel, split, contiguous):
    """The flash path (one causal call for chains; trees split into a prefix call with
    its lse and a dense tree part, merged) with the flash call replaced, against the
    torch backend and the dense reference."""
    pb = make_problem(contiguous=contiguous)
    meta = build_varlen_metadata(pb.specs, 4, "cpu", kernel, split_by_query_len=split)
    assert meta.tree is not None and len(meta.groups) == (5 if split else 1)
    k_cache, v_cache = fresh(pb)
    out = paged_attention(pb.q, pb.k, pb.v, (k_cache, v_cache), meta)
    torch.testing.assert_close(out.double(), pb.reference, atol=1e-5, rtol=1e-5)
    ref_k, ref_v = fresh(pb)
    ref = torch_backend.paged_attention(pb.q, pb.k, pb.v, (ref_k, ref_v), build_attention_metadata(pb.specs, 4))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # the same K/V written to the same slots


def test_tree_split_fails_without_the_prefix_part():
    """Power check of the test above: a tree merge that drops the prefix's lse is wrong."""
    pb = make_problem(cases=[(13, 6, (-1, 0, 0, 1, 1, 2))])
    meta = build_varlen_metadata(pb.specs, 4, "cpu", reference_kernel)
    meta.tree.has_prefix.fill_(False)  # as if the committed context were empty
    out = paged_attention(pb.q, pb.k, pb.v, fresh(pb), meta)
    assert not torch.allclose(out.double(), pb.reference, atol=1e-2)


def fake_flash_attn_module(calls):
    """A stand-in ``flash_attn`` with flash_attn_varlen_func's signature and documented
    contract: paged K/V (block_table) with blocks of a multiple of 256 tokens, int32
    metadata, and with return_attn_probs (out, softmax_lse [H, total_q], S_dmask)."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        assert k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == block_table.dtype == torch.int32
        assert block_table.shape[1] * k.shape[1] >= max_seqlen_k and return_attn_probs
        assert window_size[1] in (-1, 0) and (window_size[0] >= 0) == (window_size[1] == 0)
        calls.append(causal)
        g = VarlenGroup(None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal,
                        window_size[0])
        out, lse = reference_kernel(q, k, v, g, softmax_scale, softcap or None)
        return out, lse.transpose(0, 1).contiguous(), None

    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


def test_flash_backend_through_a_stand_in_flash_attn(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn_module(calls))
    pb = make_problem(block_size=256)
    meta = FLASH_ATTN.build_metadata(pb.specs, 256, "cpu")
    assert meta.kernel is flash_kernel
    out = paged_attention(pb.q, pb.k, pb.v, fresh(pb), meta)
    torch.testing.assert_close(out.double(), pb.reference, atol=1e-5, rtol=1e-5)
    assert calls == [True, False]  # chains causal, then the trees' prefix


def test_backend_selection():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_backend("auto", cpu, torch.float32) is (CPU if cpu_kernels.load() is not None else TORCH)
    assert select_backend("auto", cpu, torch.bfloat16) is TORCH  # the kernel is float32 only
    with pytest.raises(ValueError, match="cpu needs float32 on the CPU"):
        select_backend("cpu", cpu, torch.bfloat16)
    assert select_backend("torch_varlen", cpu, torch.float32) is TORCH_VARLEN
    assert select_backend("auto", cuda, torch.float32) is TORCH_VARLEN  # flash-attn has no fp32
    with pytest.raises(ValueError, match="flash_attn needs a CUDA device"):
        select_backend("flash_attn", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="must be one of"):
        select_backend("xformers", cpu, torch.float32)
    assert (FLASH_ATTN.block_size(16), FLASH_ATTN.block_size(512), TORCH.block_size(16)) == (256, 512, 16)


def test_flash_attn_is_auto_on_cuda_when_installed(monkeypatch):
    monkeypatch.setattr("engine.attention.backends.flash_attn_installed", lambda: True)
    assert select_backend("auto", torch.device("cuda"), torch.bfloat16) is FLASH_ATTN
    assert select_backend("auto", torch.device("cpu"), torch.bfloat16) is TORCH


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no AVX2/FMA CPU or no C compiler")
@pytest.mark.parametrize(
    "head_dim, heads", [(8, (4, 2)), (64, (9, 3)), (64, (10, 2)), (128, (5, 1)), (20, (2, 2))],
    ids=["d8", "d64-gqa3", "d64-gqa5", "d128-gqa5", "d20-mha"],
)
def test_cpu_backend_matches_the_dense_reference(head_dim, heads, kernel_build):
    """Every query (decodes, chains, trees, forests, long prefill chunks) through the C kernel
    (AVX-512 passes of 4 heads at D = 64 and 2 at D = 128, with a remainder; AVX2 for other D);
    q a strided view of a fused qkv, as the model passes it."""
    p = make_problem(head_dim=head_dim, num_heads=heads[0], num_kv_heads=heads[1])
    meta = CPU.build_metadata(p.specs, 4)
    assert meta.lists_all(len(p.q)) and not meta.batched and not meta.solo
    qkv = torch.cat([p.q.flatten(1), p.k.flatten(1)], dim=1)
    q = qkv[:, : p.q[0].numel()].view_as(p.q)
    out = paged_attention(q, p.k, p.v, (p.k_cache, p.v_cache), meta)
    torch.testing.assert_close(out.double(), p.reference, atol=1e-5, rtol=1e-5)


def test_cases_cover_every_path():
    kinds = {("tree" if p else "chain", c > 0, m > 64) for c, m, p in CASES}
    assert {("tree", False, False), ("tree", True, True), ("chain", False, True), ("chain", True, False)} <= kinds


# Sliding windows (Mistral, Gemma), a query scale (Gemma's query_pre_attn_scalar) and soft-capped
# scores (Gemma 2) in every backend, against the dense reference. A window of 5 binds in most
# cases: long prefills, chains, decodes, and trees whose nodes see 5 - depth committed keys.
WINDOWED = dict(window=5, scale=0.2, softcap=3.0)


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["no-cap", "softcap"])
@pytest.mark.parametrize("backend", ["torch", "cpu", "torch_varlen", "flash-path"])
def test_every_backend_attends_within_the_window(backend, softcap, monkeypatch):
    if backend == "cpu" and cpu_kernels.load() is None:
        pytest.skip("no AVX2/FMA CPU or no C compiler")
    kw = dict(WINDOWED, softcap=softcap)
    p = make_problem(head_dim=64 if backend == "cpu" else 8, num_heads=4, num_kv_heads=2, block_size=4, **kw)
    builders = {"torch": TORCH.build_metadata, "cpu": CPU.build_metadata, "torch_varlen": TORCH_VARLEN.build_metadata,
                "flash-path": lambda specs, bs: build_varlen_metadata(specs, bs, "cpu", reference_kernel)}
    meta = builders[backend](p.specs, 4) if backend == "flash-path" else builders[backend](p.specs, 4, "cpu")
    out = paged_attention(p.q, p.k, p.v, fresh(p), meta, window=5, scale=0.2, softcap=softcap)
    torch.testing.assert_close(out.double(), p.reference, atol=1e-5, rtol=1e-5)
    assert 5 in meta.windowed  # built once for the step, kept for the next layer of that window
    unwindowed = paged_attention(p.q, p.k, p.v, fresh(p), meta, scale=0.2, softcap=softcap)
    assert not torch.allclose(unwindowed.double(), p.reference, atol=1e-2)  # power: the window matters here


def test_a_window_that_binds_nowhere_reuses_the_step_metadata():
    p = make_problem(cases=[(2, 3, None), (0, 4, (-1, 0, 1, 1))])  # positions up to 4
    meta = TORCH.build_metadata(p.specs, 4)
    assert meta.for_window(5) is meta and meta.for_window(4) is not meta


def test_flash_backend_passes_the_window_and_softcap_through_a_stand_in(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn_module(calls))
    p = make_problem(block_size=256, **WINDOWED)
    meta = FLASH_ATTN.build_metadata(p.specs, 256, "cpu")
    out = paged_attention(p.q, p.k, p.v, fresh(p), meta, **WINDOWED)
    torch.testing.assert_close(out.double(), p.reference, atol=1e-5, rtol=1e-5)
    # chains causal; then the trees' nodes over their context, one call per depth within the window
    assert calls[0] is True and calls[1:] and not any(calls[1:])
