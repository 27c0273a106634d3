"""The flash_attn backend through flash-attn 2.8.3's own Python interface (fetched from
PyPI at test time, unmodified) over a stand-in for its compiled module that enforces
``mha_varlen_fwd``'s argument checks (``flash_attn_standin``); FlexAttention on the CPU
as a second, independent reference for tree masks and their log-sum-exp."""

import warnings

import pytest
import torch

from bench.attention_problems import make_problem
from engine.attention import paged_attention
from engine.attention.backends import FLASH_ATTN, TORCH_VARLEN
from engine.attention.lse import masked_attention_lse, merge_attention
from engine.attention.metadata import tree_mask
from tests.gpu_fake import flash_attn_standin
from tests.gpu_fake.fake_cuda import fake_cuda, value
from tests.gpu_fake.flash_attn_sdist import real_flash_attn

CUDA = torch.device("cuda")
BF16_TOL = 3e-2
# (context_len, query_len, parents): prefills, a chunk, decodes (one across a page), a chain,
# trees (a forest; one with no context: its prefix call has no key).
CASES = [(0, 9, None), (10, 7, None), (300, 1, None), (23, 1, None), (7, 4, None), (13, 6, (-1, 0, 0, 1, 1, 2)),
         (5, 3, (-1, -1, 1)), (0, 3, (-1, 0, 0))]


@pytest.fixture
def flash():
    with fake_cuda(), real_flash_attn() as flash_attn:
        flash_attn_standin.calls.clear()
        yield flash_attn


def test_flash_backend_matches_the_dense_reference(flash):
    """``CASES`` in bf16, pages of 256 tokens."""
    pb = make_problem(CASES, block_size=256, dtype=torch.bfloat16, device=CUDA, num_heads=8, num_kv_heads=2, head_dim=64)
    meta = FLASH_ATTN.build_metadata(pb.specs, 256, CUDA)
    out = paged_attention(pb.q, pb.k, pb.v, (pb.k_cache, pb.v_cache), meta)
    torch.testing.assert_close(value(out).double(), pb.reference, atol=BF16_TOL, rtol=BF16_TOL)
    calls = flash_attn_standin.calls
    assert [c["causal"] for c in calls] == [True, False] and all(c["paged"] for c in calls)  # chains, tree prefixes
    assert 0 in calls[1]["k_lens"]  # the tree without context



@pytest.mark.parametrize("softcap", [None, 3.0], ids=["no-cap", "softcap"])
def test_flash_backend_attends_within_a_sliding_window(flash, softcap):
    """``CASES`` through a sliding-window layer (Mistral, Gemma) with Gemma's query scale and,
    optionally, Gemma 2's soft cap: flash-attn's ``window_size`` on the chains, and the tree
    nodes over their context one call per depth, each a one-row query with its own window."""
    kw = dict(window=5, scale=0.2, softcap=softcap)
    pb = make_problem(CASES, block_size=256, dtype=torch.bfloat16, device=CUDA, num_heads=8, num_kv_heads=2,
                      head_dim=64, **kw)
    meta = FLASH_ATTN.build_metadata(pb.specs, 256, CUDA)
    out = paged_attention(pb.q, pb.k, pb.v, (pb.k_cache, pb.v_cache), meta, **kw)
    torch.testing.assert_close(value(out).double(), pb.reference, atol=BF16_TOL, rtol=BF16_TOL)
    calls = flash_attn_standin.calls
    assert calls[0]["causal"] and len(calls) > 2 and not any(c["causal"] for c in calls[1:])  # depth by depth
    unwindowed = paged_attention(pb.q, pb.k, pb.v, (pb.k_cache, pb.v_cache), meta, scale=0.2, softcap=softcap)
    assert not torch.allclose(value(unwindowed).double(), pb.reference, atol=0.1)  # power: the window matters

def varlen_args(dtype=torch.bfloat16, page=256, heads=(4, 2), d=64, q_len=3, k_len=300):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(q_len, heads[0], d, generator=g).to(CUDA, dtype)
    cache = torch.randn(2, page, heads[1], d, generator=g).to(CUDA, dtype)
    return dict(q=q, k=cache, v=cache.clone(), cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32, device=CUDA),
                cu_seqlens_k=torch.tensor([0, k_len], dtype=torch.int32, device=CUDA), max_seqlen_q=q_len,
                max_seqlen_k=k_len, causal=True, return_attn_probs=True,
                block_table=torch.tensor([[1, 0]], dtype=torch.int32, device=CUDA))


BAD = {  # what mha_varlen_fwd refuses, and its message
    "float32": (lambda a: a.update(q=a["q"].float(), k=a["k"].float(), v=a["v"].float()), "only support fp16 and bf16"),
    "int64 cu_seqlens": (lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"].long()), "cu_seqlens_k must have dtype int32"),
    "int64 block_table": (lambda a: a.update(block_table=a["block_table"].long()), "block_table must have dtype torch.int32"),
    "strided block_table": (lambda a: a.update(block_table=torch.tensor([[1, 9], [0, 9]], dtype=torch.int32,
                                                                        device=CUDA).t()[:1]),
                            "block_table must have contiguous last dimension"),
    "pages of 16": (lambda a: a.update(k=a["k"].reshape(32, 16, 2, 64), v=a["v"].reshape(32, 16, 2, 64)),
                    "divisible by 256"),
    "head_dim 264": (lambda a: a.update(q=torch.zeros(3, 4, 264, dtype=torch.bfloat16, device=CUDA),
                                        k=torch.zeros(2, 256, 2, 264, dtype=torch.bfloat16, device=CUDA),
                                        v=torch.zeros(2, 256, 2, 264, dtype=torch.bfloat16, device=CUDA)), "at most 256"),
    "6 heads over 4": (lambda a: a.update(q=torch.zeros(3, 6, 64, dtype=torch.bfloat16, device=CUDA),
                                          k=torch.zeros(2, 256, 4, 64, dtype=torch.bfloat16, device=CUDA),
                                          v=torch.zeros(2, 256, 4, 64, dtype=torch.bfloat16, device=CUDA)), "must divide"),
    "cu_seqlens on the CPU": (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].cpu()), "cu_seqlens_q must be on CUDA"),
    "max_seqlen_q too small": (lambda a: a.update(max_seqlen_q=2), "would not be computed"),
    "block outside the cache": (lambda a: a.update(block_table=torch.tensor([[1, 7]], dtype=torch.int32, device=CUDA)),
                                "outside the cache"),
}


@pytest.mark.parametrize("case", BAD)
def test_the_stand_in_refuses_what_flash_attn_refuses(flash, case):
    args = varlen_args()
    flash.flash_attn_varlen_func(**args)  # the good call passes
    change, message = BAD[case]
    change(args)
    with pytest.raises(RuntimeError, match=message):
        flash.flash_attn_varlen_func(**args)


def test_rows_without_keys_get_zero_and_lse_plus_infinity(flash):
    args = varlen_args(k_len=0)
    args.update(cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32, device=CUDA), max_seqlen_k=5, causal=False,
                cu_seqlens_k=torch.tensor([0, 0, 5], dtype=torch.int32, device=CUDA),
                block_table=torch.tensor([[0], [1]], dtype=torch.int32, device=CUDA))
    out, lse, _ = flash.flash_attn_varlen_func(**args)
    assert value(out)[0].abs().max() == 0 and torch.isinf(value(lse)[:, 0]).all() and (value(lse)[:, 0] > 0).all()
    assert torch.isfinite(value(lse)[:, 1:]).all()


def flex_reference(q, keys, vals, mask):
    """FlexAttention (CPU, float32) of one request: q [m, H, D], keys [n, KVH, D], mask [m, n]
    -> (out [m, H, D], lse [m, H])."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    m, n = mask.shape
    block_mask = create_block_mask(lambda b, h, i, j: mask[i, j], None, None, m, n, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unfused (uncompiled) path is the point: an independent reference
        out, lse = flex_attention(q.float().transpose(0, 1)[None], keys.float().transpose(0, 1)[None],
                                  vals.float().transpose(0, 1)[None], block_mask=block_mask, return_lse=True,
                                  enable_gqa=True)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


@pytest.mark.parametrize("kernel", ["torch_varlen", "flash_attn"])
def test_tree_split_and_merge_match_flex_attention(kernel):
    """A tree's attention as the varlen backends compute it (the committed prefix through the
    kernel with its lse, the nodes among themselves with the tree mask, merged by lse)
    against FlexAttention over the whole mask: outputs and log-sum-exps."""
    parents = (-1, 0, 0, 1, 1, 2, -1)
    cases = [(37, len(parents), parents), (0, 3, (-1, 0, 0))]
    torch_varlen = kernel == "torch_varlen"
    backend, dtype, device = (TORCH_VARLEN, torch.float32, "cpu") if torch_varlen else (FLASH_ATTN, torch.bfloat16, CUDA)
    with fake_cuda(), real_flash_attn():
        pb = make_problem(cases, block_size=backend.block_size(16), dtype=dtype, device=device, num_heads=4,
                          num_kv_heads=2, head_dim=16)
        meta = backend.build_metadata(pb.specs, backend.block_size(16), device)
        t, scale = meta.tree, 16**-0.5
        q_nodes = pb.q.index_select(0, t.valid_tokens)
        (prefix,) = meta.tree_prefixes  # no sliding window: one group of every node
        out_p, lse_p = meta.kernel(q_nodes, pb.k_cache, pb.v_cache, prefix, scale)
        lse_p = lse_p.masked_fill(~t.has_prefix[:, None], float("-inf"))
        n, width = t.token_index.shape
        flat = t.token_index.view(-1)
        out_t, lse_t = masked_attention_lse(*(x.index_select(0, flat).view(n, width, *x.shape[1:]) for x in (pb.q, pb.k, pb.v)),
                                            t.mask, scale)
        out_t = out_t.view(n * width, *pb.q.shape[1:]).index_select(0, t.valid_rows)
        lse_t = lse_t.view(n * width, -1).index_select(0, t.valid_rows)
        out, lse = (value(x).float() for x in merge_attention(out_t, lse_t, out_p, lse_p))
    start = 0
    for spec, (c, m, tree) in zip(pb.specs, cases):
        bs = pb.k_cache.shape[1]
        slots = [spec.block_table[p // bs] * bs + p % bs for p in range(c)]
        keys = torch.cat([value(pb.k_cache).flatten(0, 1)[slots], value(pb.k)[start : start + m]])
        vals = torch.cat([value(pb.v_cache).flatten(0, 1)[slots], value(pb.v)[start : start + m]])
        mask = torch.cat([torch.ones(m, c, dtype=torch.bool), torch.from_numpy(tree_mask(tree))], dim=1)
        ref_out, ref_lse = flex_reference(value(pb.q)[start : start + m], keys, vals, mask)
        tol = 1e-4 if dtype == torch.float32 else BF16_TOL
        torch.testing.assert_close(out[start : start + m], ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[start : start + m], ref_lse, atol=tol, rtol=tol)
        start += m


def test_the_image_build_check_over_flash_attns_interface(tmp_path, monkeypatch):
    """deploy/flash_attn_check.py, which the Docker build runs without a GPU: it passes when
    the kernels load and their entry runs, and fails on a wheel that does not load."""
    from deploy.flash_attn_check import check

    with real_flash_attn():
        assert check().startswith("flash-attn 2.8.3 loads with torch")
    broken = tmp_path / "flash_attn_2_cuda.py"
    broken.write_text("raise ImportError('undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with real_flash_attn():
        monkeypatch.delitem(__import__("sys").modules, "flash_attn_2_cuda")
        with pytest.raises(ImportError, match="undefined symbol"):
            check()
