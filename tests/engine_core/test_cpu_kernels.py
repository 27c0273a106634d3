"""The CPU kernels: same numbers as torch (``x @ w.T`` and the rest), and a row's result
independent of the batch: the matmul's at any row count, the attention's whatever other
queries share the step. The kernel tests run against the build for this CPU and, where that
one has AVX-512, against the AVX2-only build too (``kernel_build``)."""

import pytest
import torch

from engine.layers import cpu_kernels
from engine.layers.linear import CFloat32Linear, ColumnParallelLinear
from engine.models.arch import MoESpec, llama_arch
from tests.engine_core.conftest import AVX512_BUILD, other_vendor_build

needs_kernel = pytest.mark.skipif(cpu_kernels.load() is None, reason="no AVX2/FMA CPU or no C compiler")


@needs_kernel
@pytest.mark.parametrize(
    "m, n, k",
    [(1, 96, 64), (1, 130, 100), (1, 1000, 70), (2, 7, 33), (2, 200, 64), (3, 576, 576), (4, 5, 1536), (5, 130, 100),
     (8, 64, 31), (9, 3, 40), (10, 130, 100), (16, 64, 576), (33, 9, 37), (70, 100, 64), (200, 50, 30)],
)
def test_matmul_matches_torch(m, n, k, kernel_build):
    """Odd row and feature counts, K not a multiple of the vector width, more rows than one block."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    kw = cpu_kernels.kernel_weight(w)
    torch.testing.assert_close(cpu_kernels.matmul(x, kw), x @ w.T, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_matmul_reads_a_non_contiguous_input(kernel_build):
    x = torch.randn(16, 64)[::4]  # rows of a larger tensor
    w = torch.randn(10, 64)
    kw = cpu_kernels.kernel_weight(w)
    torch.testing.assert_close(cpu_kernels.matmul(x, kw), x @ w.T, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_matmul_row_results_do_not_depend_on_the_batch(kernel_build):
    """A row's bits are the same alone and at any place among any number of other rows (row
    groups of 4, work items of 64 rows, K in chunks, panels side by side or taking turns), and
    equal to one FMA chain over k in order."""
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(300, 200, generator=g), torch.randn(150, 200, generator=g)
    kw = cpu_kernels.kernel_weight(w)
    alone = torch.cat([cpu_kernels.matmul(x[i : i + 1], kw) for i in range(150)])
    for m in (2, 3, 4, 5, 7, 8, 9, 17, 64, 65, 150):
        assert torch.equal(cpu_kernels.matmul(x[:m], kw), alone[:m])
    assert torch.equal(cpu_kernels.matmul(x[37:101], kw), alone[37:101])
    chain = torch.zeros(3, 300, dtype=torch.float64)  # the chain in float64, each step rounded to float32 by FMA
    for j in range(200):
        chain = (chain + x[:3, j : j + 1].double() * w[:, j].double()).float().double()
    assert torch.equal(alone[:3], chain.float())


@needs_kernel
def test_matmul_streams_give_a_row_its_bits_alone_in_every_build():
    """At 1 to 16 rows over 1, 2 and 3 threads, with work items of 1 to 4 panels (side by side
    in registers, or taking turns over k), every build (this CPU's; the AVX2 one and the
    AVX-512 one of the other CPU vendor where this CPU has AVX-512) gives each row the bits
    it gets alone in this CPU's build."""
    libs = [cpu_kernels.load()]
    if AVX512_BUILD:
        libs += [cpu_kernels.build(cpu_kernels.compiler(), cpu_kernels.FLAGS), other_vendor_build()]
    g = torch.Generator().manual_seed(9)
    for n in (300, 1000):
        w, x = torch.randn(n, 200, generator=g), torch.randn(16, 200, generator=g)
        alone = torch.cat([cpu_kernels.matmul(x[i : i + 1], cpu_kernels.kernel_weight(w)) for i in range(16)])
        torch.testing.assert_close(alone, x @ w.T, rtol=1e-4, atol=1e-4)
        for lib in libs:
            kw = cpu_kernels.kernel_weight(w, lib)
            for threads in (1, 2, 3):
                for m in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16):
                    y = torch.empty(m, n)
                    lib.matmul_f32(x.data_ptr(), kw.data.data_ptr(), y.data_ptr(), m, n, 200, threads)
                    assert torch.equal(y, alone[:m]), (lib, n, threads, m)


@needs_kernel
@pytest.mark.skipif(not AVX512_BUILD, reason="this CPU's build is the AVX2 one")
def test_matmul_gives_the_same_bits_in_the_avx2_and_avx512_builds():
    avx2 = cpu_kernels.build(cpu_kernels.compiler(), cpu_kernels.FLAGS)
    g = torch.Generator().manual_seed(8)
    w, x = torch.randn(130, 100, generator=g), torch.randn(9, 100, generator=g)
    y = torch.empty(9, 130)
    wa = cpu_kernels.kernel_weight(w, avx2)
    avx2.matmul_f32(x.data_ptr(), wa.data.data_ptr(), y.data_ptr(), 9, 130, 100, 2)
    assert torch.equal(cpu_kernels.matmul(x, cpu_kernels.kernel_weight(w)), y)


@needs_kernel
def test_a_prepacked_layer_sends_every_row_count_through_the_kernel(monkeypatch):
    layer = ColumnParallelLinear(64, [96])
    layer.load(0, torch.randn(96, 64))
    layer.prepack()
    assert isinstance(layer.linear_kernel, CFloat32Linear)  # no oneDNN copy beside it
    calls = []
    monkeypatch.setattr(cpu_kernels, "matmul", lambda x, w: calls.append(len(x)) or x @ layer.weight.T)
    with torch.inference_mode():
        for rows in (1, 4, 5, 16, 300):
            layer(torch.randn(rows, 64))
    assert calls == [1, 4, 5, 16, 300]


@needs_kernel
@pytest.mark.parametrize("rows, hidden", [(1, 576), (3, 64), (70, 100), (2, 13)])
def test_rms_norm_matches_torch(rows, hidden):
    """Few rows and many (threaded), hidden sizes off the vector width."""
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, hidden, generator=g) * 3, torch.randn(hidden, generator=g)
    expected = torch.nn.functional.rms_norm(x, (hidden,), w, 1e-5)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-5), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_rms_norm_module_uses_the_kernel_only_outside_autograd():
    from engine.layers.norm import RMSNorm

    norm = RMSNorm(64, 1e-6)
    norm.weight.data.normal_()
    norm.weight.requires_grad_(True)
    x = torch.randn(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (64,), norm.weight, 1e-6))
    norm(x).sum().backward()  # with autograd on: torch's op, so the weight gets a gradient
    assert norm.weight.grad is not None


@needs_kernel
@pytest.mark.parametrize("rows, inter", [(1, 1536), (5, 13), (17, 64)])
def test_silu_mul_matches_torch(rows, inter):
    gate_up = torch.randn(rows, 2 * inter) * 6  # past exp's clamps at both ends
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up,
                               rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows, n", [(1, 49152), (5, 49152), (3, 7), (2, 8), (4, 29)])
def test_argmax_rows_is_torchs_first_maximum(rows, n):
    """The greedy token of each row of logits: the first of tied maxima, the first NaN, and
    index 0 of a row of -inf, as torch's max(-1).indices gives them."""
    g = torch.Generator().manual_seed(rows * n)
    cases = [torch.randn(rows, n, generator=g), torch.randint(-2, 2, (rows, n), generator=g).float()]
    nan = torch.randn(rows, n, generator=g)
    nan[torch.rand(rows, n, generator=g) < 0.2] = float("nan")
    signed = torch.zeros(rows, n)
    signed[torch.rand(rows, n, generator=g) < 0.5] = -0.0
    cases += [nan, signed, torch.full((rows, n), -float("inf")), torch.full((rows, n), float("inf"))]
    with torch.no_grad():
        assert cpu_kernels.usable(cases[0])
        for x in cases:
            assert cpu_kernels.argmax_rows(x) == x.max(-1).indices.tolist()


@needs_kernel
def test_rope_matches_torch_on_a_strided_view():
    from engine.layers.rotary import _rotate_half

    qkv = torch.randn(5, 7 * 16)  # 4 query heads, 1 key head, 2 value heads of 16
    x = qkv[:, : 5 * 16].view(5, 5, 16)  # queries and keys, rows 7 * 16 apart
    cos, sin = torch.randn(5, 1, 16), torch.randn(5, 1, 16)
    torch.testing.assert_close(cpu_kernels.rope(x, cos, sin), x * cos + _rotate_half(x) * sin)


@needs_kernel
def test_paged_attention_of_a_token_does_not_depend_on_the_others(kernel_build):
    from bench.attention_problems import make_problem

    from engine.attention import build_attention_metadata, paged_attention

    p = make_problem(head_dim=64, num_heads=9, num_kv_heads=3)
    meta = build_attention_metadata(p.specs, 4, listed=True)
    together = paged_attention(p.q, p.k, p.v, (p.k_cache.clone(), p.v_cache.clone()), meta)
    decode = next(i for i, s in enumerate(p.specs) if (s.context_len, s.query_len) == (23, 1))
    row = sum(s.query_len for s in p.specs[:decode])
    alone = build_attention_metadata([p.specs[decode]], 4, listed=True)
    one = paged_attention(p.q[row : row + 1], p.k[row : row + 1], p.v[row : row + 1],
                          (p.k_cache.clone(), p.v_cache.clone()), alone)
    assert torch.equal(one[0], together[row])


@needs_kernel
@pytest.mark.parametrize("c, m", [(37, 7), (150, 33), (0, 80), (250, 9), (700, 3)],
                         ids=["in-registers", "key-blocks", "prefill", "across-parts", "three-parts"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 2, 128), (6, 6, 64), (4, 2, 48), (3, 1, 36)])
def test_paged_attention_of_a_chain_gives_each_row_its_bits_alone(kernel_build, heads, kv_heads, head_dim, c, m):
    """The rows of a draft chain or a prefill chunk share their request's list and are attended together (with
    AVX-512, up to 4 query vectors in registers; with many rows, up to 16 a work item,
    the keys in blocks of 64, read once for all of them; in the AVX2 build, lists past 256 keys
    in parts of 256 attended apart and merged): row i still gets the bits of one query after
    c + i keys, and the softmax over exactly those keys."""
    g = torch.Generator().manual_seed(heads * head_dim)
    num_slots = c + m + 27
    k_cache, v_cache = (torch.randn(num_slots, kv_heads, head_dim, generator=g) for _ in range(2))
    q = torch.randn(m, heads, head_dim, generator=g)
    slots = torch.randperm(num_slots, generator=g)[: c + m]
    out = torch.empty_like(q)
    ids = lambda *xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    cpu_kernels.paged_attention(q, k_cache, v_cache, torch.arange(m), torch.zeros(m, dtype=torch.int64),
                                torch.arange(c + 1, c + m + 1), slots, out)
    for i in range(m):
        alone = torch.empty(1, heads, head_dim)
        cpu_kernels.paged_attention(q[i : i + 1], k_cache, v_cache, ids(0), ids(0), ids(c + i + 1), slots, alone)
        assert torch.equal(out[i], alone[0])
        keys = k_cache[slots[: c + i + 1]].repeat_interleave(heads // kv_heads, 1)  # [L, H, D]
        values = v_cache[slots[: c + i + 1]].repeat_interleave(heads // kv_heads, 1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[i], keys) / head_dim**0.5, -1)
        torch.testing.assert_close(out[i], torch.einsum("hl,lhd->hd", weights, values), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("shared", [0, 40], ids=["mixtral", "shared-expert"])
def test_moe_matches_torch_and_a_token_alone(kernel_build, shared):
    """``moe``: each token's top-2 of 5 experts (softmax, renormalized without a shared
    expert, as Mixtral; with one, unnormalized plus sigmoid(gate) * shared, as Qwen2-MoE)
    weighted and summed; every token's row is the same bits computed alone."""
    E, K, Hd, inter, T = 5, 2, 64, 48, 9
    g = torch.Generator().manual_seed(7 + shared)
    rnd = lambda *shape: torch.randn(*shape, generator=g) * shape[-1] ** -0.5  # noqa: E731
    router, experts = rnd(E, Hd), [(rnd(2 * inter, Hd), rnd(Hd, inter)) for _ in range(E)]
    shared_w = (rnd(1, Hd), rnd(2 * shared, Hd), rnd(Hd, shared)) if shared else None
    kw = cpu_kernels.kernel_weight
    args = cpu_kernels.moe_args(kw(router), [(kw(a), kw(b)) for a, b in experts], K, not shared,
                                shared_w and tuple(kw(m) for m in shared_w))
    x = torch.randn(T, Hd, generator=g)

    def mlp(x, gate_up, down):
        gate, up = (x @ gate_up.T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ down.T

    weights, ids = torch.topk(torch.softmax(x @ router.T, -1), K)
    if not shared:
        weights = weights / weights.sum(-1, keepdim=True)
    want = torch.stack([sum(weights[t, j] * mlp(x[t], *experts[ids[t, j]]) for j in range(K)) for t in range(T)])
    if shared:
        want += torch.sigmoid(x @ shared_w[0].T) * mlp(x, *shared_w[1:])
    got = cpu_kernels.moe(x, args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for t in range(T):
        assert torch.equal(cpu_kernels.moe(x[t : t + 1], args)[0], got[t])


FUSED_FAMILIES = {  # the families whose layers run as one C call, as the shared decoder builds them
    "llama": None,
    "qwen2-biases": lambda c: llama_arch(c, qkv_bias=True, o_bias=False),
    "qwen3-qk-norm": lambda c: llama_arch(c, qk_norm="head"),
    "mistral-window": lambda c: llama_arch(c, windows=(4, None)),  # one sliding layer of 4 positions, one global
    "mixtral-moe": lambda c: llama_arch(c, moe=MoESpec(4, 2, 96, True), moe_layers=(True, False)),  # then dense
    "qwen2-moe-shared": lambda c: llama_arch(c, qkv_bias=True, o_bias=False, moe=MoESpec(4, 2, 48, False, 80),
                                             moe_layers=(True, True)),
}


@needs_kernel
@pytest.mark.parametrize("family", list(FUSED_FAMILIES))
@pytest.mark.parametrize("heads, head_dim", [((4, 2), 64), ((3, 3), 48)], ids=["d64-gqa2", "d48-mha"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["kv-f32", "kv-bf16"])
def test_fused_layers_give_the_bits_of_the_layer_modules(tiny_model, kernel_build, heads, head_dim, family, kv_dtype):
    """A decode and verification step (decodes, a chain, a tree) through one C call per
    layer gives the same logits and KV cache bits as the layer modules' kernel calls, for
    Llama and the families close to it (biases, q/k norms, sliding windows, experts); with a
    bfloat16 cache, the C write rounds every key and value as torch's conversion does."""
    from engine.attention import SeqSpec, build_attention_metadata
    from tests.engine_core.engine_helpers import scratch_cache

    model = tiny_model(hidden_size=heads[0] * head_dim, num_attention_heads=heads[0], num_key_value_heads=heads[1],
                       intermediate_size=200, arch=FUSED_FAMILIES[family])
    model.prepack()
    fused = model.fused  # every layer's one C call
    assert fused is not None
    kv = scratch_cache(model, 16, 4, kv_dtype)
    g = torch.Generator().manual_seed(3)
    contexts = [9, 14, 5]
    with torch.inference_mode():
        for i, n in enumerate(contexts):  # prefill each request through the layer modules
            spec = SeqSpec(0, n, list(range(4 * i, 4 * i + 4)))
            ids = torch.randint(0, 512, (n,), generator=g)
            model(ids, torch.arange(n), build_attention_metadata([spec], 4, listed=True), kv)
        specs = [SeqSpec(9, 1, [0, 1, 2, 3]), SeqSpec(14, 2, [4, 5, 6, 7]), SeqSpec(5, 4, [8, 9, 10, 11], (-1, 0, 0, 1))]
        ids = torch.randint(0, 512, (7,), generator=g)
        pos = torch.tensor([9, 14, 15, 5, 6, 6, 7])
        out = {}
        for name, layers in (("modules", None), ("fused", fused)):
            model.fused = layers
            cache = scratch_cache(model, 16, 4, kv_dtype)
            for i in range(len(model.layers)):
                for dst, src in zip(cache.layer(i), kv.layer(i)):
                    dst.copy_(src)
            meta = build_attention_metadata(specs, 4, listed=True)
            ropes = {kind: rope(pos, torch.float32) for kind, rope in model.rotaries.items()}
            assert layers is None or layers.step(torch.empty(7, model.config.hidden_size), ropes, meta) is not None
            out[name] = (model.compute_logits(model(ids, pos, meta, cache)), cache)
    assert torch.equal(out["modules"][0], out["fused"][0])
    for i in range(len(model.layers)):
        for a, b in zip(out["modules"][1].layer(i), out["fused"][1].layer(i)):
            assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize("bias, qk_norm", [(True, False), (False, True), (True, True)])
def test_fused_layer_adds_the_qkv_bias_and_normalizes_each_q_and_k_head(kernel_build, bias, qk_norm):
    """``decoder_layer`` with a qkv bias and per-head q/k norms (Qwen2, Qwen3) gives the bits of
    the same kernels called one by one: qkv product, + bias, rms-norm of each D-wide head, rope,
    attention, o, the MLP; and the keys it writes are the normed, rotated ones."""
    T, Hd, H, KVH, D, inter, eps = 3, 64, 4, 2, 16, 96, 1e-6
    g = torch.Generator().manual_seed(11)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    w = [rnd(n, k) * k**-0.5 for n, k in (((H + 2 * KVH) * D, Hd), (Hd, H * D), (2 * inter, Hd), (Hd, inter))]
    ln1, ln2, b_qkv, qn, kn = rnd(Hd), rnd(Hd), rnd((H + 2 * KVH) * D), rnd(D), rnd(D)
    kernels = tuple(cpu_kernels.kernel_weight(m) for m in w)
    x, cos, sin = rnd(T, Hd), rnd(T, 1, D), rnd(T, 1, D)
    slot_mapping = torch.tensor([5, 6, 7])
    rows, start, length, slots = torch.arange(3), torch.zeros(3, dtype=torch.int64), torch.tensor([6, 7, 8]), torch.arange(8)
    caches = [(torch.randn(2, 4, KVH, D, generator=torch.Generator().manual_seed(1)),
               torch.randn(2, 4, KVH, D, generator=torch.Generator().manual_seed(2))) for _ in range(2)]
    # the kernels one by one
    k_flat, v_flat = (c.view(-1, KVH, D) for c in caches[0])
    qkv = cpu_kernels.matmul(cpu_kernels.rms_norm(x, ln1, eps), kernels[0])
    if bias:
        qkv = qkv + b_qkv
    qk = qkv[:, : (H + KVH) * D]
    if qk_norm:
        qk = torch.cat([cpu_kernels.rms_norm(qk[:, : H * D].reshape(-1, D), qn, eps).view(T, -1),
                        cpu_kernels.rms_norm(qk[:, H * D :].reshape(-1, D), kn, eps).view(T, -1)], dim=1)
    qk = cpu_kernels.rope(qk.reshape(T, H + KVH, D), cos, sin)
    k_flat[slot_mapping], v_flat[slot_mapping] = qk[:, H:], qkv[:, (H + KVH) * D :].view(T, KVH, D)
    att = torch.empty(T, H, D)
    cpu_kernels.paged_attention(qk[:, :H], k_flat, v_flat, rows, start, length, slots, att)
    h = x + cpu_kernels.matmul(att.view(T, -1), kernels[1])
    ref = h + cpu_kernels.matmul(cpu_kernels.silu_mul(cpu_kernels.matmul(cpu_kernels.rms_norm(h, ln2, eps), kernels[2])),
                               kernels[3])
    # one call
    layer = cpu_kernels.layer_args(Hd, H, KVH, D, inter, eps, (ln1, ln2), kernels, b_qkv if bias else None,
                                   (qn, kn) if qk_norm else None)
    scratch = torch.empty(cpu_kernels.scratch_size(T, Hd, H, KVH, D, inter))
    step = cpu_kernels.step_args(cos.contiguous(), sin.contiguous(), slot_mapping, rows, start, length, slots, scratch)
    fused = x.clone()
    cpu_kernels.decoder_layer(fused, layer, *caches[1], step)
    assert torch.equal(fused, ref)
    for a, b in zip(caches[0], caches[1]):
        assert torch.equal(a, b)
