"""The quantized matmul (engine/layers/csrc/quant_kernels.c) on every GGUF block format it
multiplies: against the same arithmetic written in float64 here, against the dequantized
weights in float32 (within the bound that 8-bit activations allow), row by row the same
bits at every batch size and thread count, and its VNNI builds compiled."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.layers import cpu_kernels, quant

pytestmark = pytest.mark.skipif(quant.load() is None, reason="no CPU kernels here (AVX2, a C compiler)")


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random block bytes of ``kind`` [rows, row_bytes]: every code pattern, scales kept finite
    and of a weight's size (the fp16 fields set, the rest random)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    n = rows * cols // block
    data = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    f16 = lambda lo, hi: rng.uniform(lo, hi, n).astype(np.float16).view(np.uint8).reshape(n, 2)  # noqa: E731
    if kind in ("Q4_0", "Q8_0"):
        data[:, 0:2] = f16(-0.02, 0.02)
    elif kind == "Q4_1":
        data[:, 0:2], data[:, 2:4] = f16(0, 0.02), f16(-0.15, 0)
    elif kind in ("Q4_K", "Q5_K"):
        data[:, 0:2], data[:, 2:4] = f16(0, 0.002), f16(0, 0.004)
    else:  # Q6_K: d last; its int8 sub-scales stay random (negative ones too)
        data[:, 208:210] = f16(-0.002, 0.002)
    return torch.from_numpy(data.reshape(rows, -1))


def weight(kind: str, rows: int = 37, cols: int = 512, seed: int = 0) -> quant.QuantWeight:
    return quant.QuantWeight(kind, random_blocks(kind, rows, cols, seed), cols)


def q8_emulation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's activation rule, in torch: per block of 32, scale = max|x| / 127 and codes
    round(x * 127 / max|x|) to nearest even. Returns the codes [M, K] and scales [M, K / 32]."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1)
    # 127 / amax rounded once, as the kernel does (torch's scalar / tensor is 127 * (1 / amax): two roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv[..., None]).view_as(x)
    return codes, amax / 127.0


@pytest.mark.parametrize("kind", quant.KERNEL_TYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_every_format_matches_its_dequantized_weights(kind, rows):
    """Against the same sum in float64 (dequantized weights times the 8-bit activations): within
    1e-5 of sum |w||x| (float32 rounding only). Against the float32 product of the dequantized
    weights: within the activation rounding's own bound, sum_k |w_k| max|x|_block(k) / 254."""
    w = weight(kind)
    x = torch.randn(rows, w.in_features) * torch.rand(rows, 1) * 4  # rows of different magnitudes
    y = quant.linear(x, quant.LinearArgs((w,)))
    wd = w.dequantize().double()
    codes, scale = q8_emulation(x)
    x8 = (codes.double().view(rows, -1, 32) * scale.double()[..., None]).view_as(x)
    size = x.double().abs() @ wd.abs().T
    assert ((y - x8 @ wd.T).abs() <= 1e-5 * size + 1e-6).all()
    amax = x.abs().view(rows, -1, 32).amax(-1).repeat_interleave(32, dim=1).double()
    bound = amax @ wd.abs().T / 254
    assert ((y - x.double() @ wd.T).abs() <= bound * 1.001 + 1e-5 * size).all()


@pytest.mark.parametrize("kind", quant.KERNEL_TYPES)
def test_a_row_is_the_same_bits_whatever_the_batch(kind):
    """What greedy speculation needs: row i alone, in batches of every size 1..72 (tiles of
    up to 8 rows and their remainders, past one row block of 64) and with one or two threads,
    gives the same bits; 16 chunks of 32 inputs each."""
    args = quant.LinearArgs((weight(kind, rows=45),))
    x = torch.randn(72, 512)
    alone = torch.stack([quant.linear(x[i : i + 1], args)[0] for i in range(72)])
    for m in range(1, 73):
        assert torch.equal(quant.linear(x[:m], args), alone[:m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quant.linear(x, args), alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", quant.KERNEL_TYPES)
def test_a_group_of_eight_weight_rows_is_the_same_bits_beside_another_or_alone(kind):
    """The AVX-512 build runs two groups of 8 weight rows side by side, and a last odd group
    alone: a weight row's outputs do not depend on which."""
    w = weight(kind, rows=16)
    halves = [quant.QuantWeight(kind, w.data[i : i + 8].contiguous(), w.in_features) for i in (0, 8)]
    x = torch.randn(11, 512)
    together = quant.linear(x, quant.LinearArgs((w,)))
    assert torch.equal(together, torch.cat([quant.linear(x, quant.LinearArgs((h,))) for h in halves], dim=1))


def test_stacked_parts_of_mixed_formats_equal_their_separate_products():
    """A fused QKV of a Q4_K_M file: Q4_K rows, then Q6_K, then Q8_0, in one call."""
    parts = (weight("Q4_K", 24, 512, 1), weight("Q6_K", 8, 512, 2), weight("Q8_0", 8, 512, 3))
    x = torch.randn(7, 512)
    y = quant.linear(x, quant.LinearArgs(parts))
    assert torch.equal(y, torch.cat([quant.linear(x, quant.LinearArgs((p,))) for p in parts], dim=1))


def test_activation_codes_follow_llama_cpp_rule():
    x = torch.randn(9, 256) * 3
    x[0, :32] = 0.0  # an all-zero block: scale 0, codes 0
    codes, scale, isum = quant.quantize_activations(x)
    ref_codes, ref_scale = q8_emulation(x)
    assert torch.equal(codes.float(), ref_codes) and torch.equal(scale, ref_scale)
    assert torch.equal(isum, ref_codes.view(9, -1, 32).sum(-1))


def test_merge_joins_adjacent_parts_of_one_format_only():
    a, b, c = weight("Q4_1", 4), weight("Q4_1", 8, seed=1), weight("Q6_K", 4)
    merged = quant.merge([a, b, c])
    assert [(p.kind, p.out_features) for p in merged] == [("Q4_1", 12), ("Q6_K", 4)]


@pytest.mark.parametrize("extra", [("-mavx512f",), ("-mavx512f", "-mavx512vl", "-mavx512vnni"),
                                   ("-mavx512f", "-mavx512vl", "-mavx512vnni", "-mavx512bw"), ("-mavxvnni",)],
                         ids=["avx512", "avx512-vnni-256", "avx512-vnni-512", "avx-vnni"])
def test_the_other_cpus_builds_compile(extra):
    """The AVX-512 build and the dpbusd paths compile and load (this CPU may not run them; where
    it does, the tests above run on them: ``quant.compile_flags``)."""
    lib = quant.build(cpu_kernels.compiler(), cpu_kernels.FLAGS + ("-mf16c",) + extra)
    assert lib.quant_linear is not None


@pytest.mark.parametrize("kind", quant.KERNEL_TYPES)
def test_rows_looked_up_from_the_panels_are_the_dequantized_rows(kind):
    """A quantized embedding (tied to its head) is read from the head's panels."""
    w = weight(kind, rows=45)
    ids = torch.tensor([0, 44, 7, 8, 7, 31])
    torch.testing.assert_close(quant.LinearArgs((w,)).lookup(ids), w.dequantize()[ids], rtol=1e-6, atol=1e-7)
