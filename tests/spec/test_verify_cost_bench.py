"""bench.verify_cost: the table a lent GPU should produce, kept runnable on the CPU."""

import pytest
import torch

from bench.verify_cost import LLAMA_8B, main, measure, table


def test_the_tiny_run_fills_every_cell():
    results = main(["--tiny", "--no-write", "--repeats", "2", "--context", "32"])
    assert list(results) == [1, 8, 32]
    assert all(list(ms) == [1, 2, 4, 8, 16] and all(v > 0 for v in ms.values()) for ms in results.values())
    assert table(results).count("\n") == 4  # header, rule, three batch sizes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_verifying_a_few_drafts_costs_about_a_decode_step():
    ms = measure(LLAMA_8B, torch.device("cuda"), torch.bfloat16, [1], [1, 4], context=128, repeats=5)[1]
    assert ms[4] < 1.5 * ms[1]  # batch 1 streams the 16 GB of weights either way
