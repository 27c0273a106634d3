"""A failing C kernel fails loudly: its error code becomes ``KernelError``, and the
request whose step it was gets an error, never the tokens of an unwritten output."""

import pytest
import torch

from engine.layers import cpu_kernels, quant
from engine.sampling_params import SamplingParams
from tests.engine_core.engine_helpers import run

pytestmark = pytest.mark.skipif(quant.load() is None, reason="no CPU kernels here (AVX2, a C compiler)")
NO_FORMAT = 99  # a block format with no kernel: quant_linear returns -1, its output unwritten


def test_a_quantized_matrix_without_a_kernel_ends_its_request_with_an_error(make_engine, tiny_model):
    model = tiny_model()
    model.prepack(quant.QUANTIZE_TO["int4"])
    assert model.fused is not None  # the whole-layer C call, whose matmul is quant_layer_matmul
    engine = make_engine(model, max_model_len=128)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    good = run(engine, [[1, 2, 3, 4]], params)[0].token_ids
    fmts = model.layers[1].mlp.gate_up_proj.qweight.fmts
    fmts[0], kept = NO_FORMAT, fmts[0]
    try:
        failed = run(engine, [[1, 2, 3, 4]], params, prefix="bad")[0]
    finally:
        fmts[0] = kept
    assert failed.request.finish_reason == "error" and failed.token_ids == []
    assert run(engine, [[1, 2, 3, 4]], params, prefix="again")[0].token_ids == good  # the engine goes on


def test_attention_out_of_memory_raises():
    """A list too long to allocate the scores of: the kernel returns, writing nothing."""
    q = torch.randn(1, 4, 64)
    cache = torch.zeros(4, 2, 64)
    one = torch.zeros(1, dtype=torch.int64)
    out = torch.zeros(1, 4, 64)
    with pytest.raises(cpu_kernels.KernelError, match="out of memory"):
        cpu_kernels.paged_attention(q, cache, cache, one, one, torch.tensor([2**40]), one, out)
    assert not out.any()
