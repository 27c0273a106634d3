"""oneDNN's matmul padding (the path without the C kernels): results do not depend on it
beyond rounding, and start-up picks one of the candidates."""

import pytest
import torch

from engine.layers import cpu_kernels
from engine.layers.linear import PAD_CANDIDATES, ColumnParallelLinear, OneDNNLinear, calibrate_min_rows, can_prepack


@pytest.fixture(autouse=True)
def no_kernels(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)


def _packed_layer(seed: int) -> ColumnParallelLinear:
    g = torch.Generator().manual_seed(seed)
    layer = ColumnParallelLinear(64, [96])
    layer.load(0, torch.randn(96, 64, generator=g))
    layer.prepack()
    assert isinstance(layer.linear_kernel, OneDNNLinear)
    return layer


@pytest.mark.skipif(not can_prepack(torch.empty(1)), reason="oneDNN prepacking needs the CPU float32 path")
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_padding_does_not_change_the_rows(rows):
    layer = _packed_layer(0)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(1))
    outs = []
    for pad in PAD_CANDIDATES:
        layer.linear_kernel.min_rows = pad
        outs.append(layer(x))
    reference = x @ layer.weight.T
    for out in outs:
        assert out.shape == (rows, 96)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not can_prepack(torch.empty(1)), reason="oneDNN prepacking needs the CPU float32 path")
def test_calibration_sets_one_candidate_on_every_layer():
    layers = [_packed_layer(s) for s in range(3)]
    chosen = calibrate_min_rows(layers, repeats=2)
    assert chosen in PAD_CANDIDATES
    assert {m.linear_kernel.min_rows for m in layers} == {chosen}


def test_calibration_without_packed_layers_pads_nothing():
    layer = ColumnParallelLinear(8, [8])  # never prepacked
    assert calibrate_min_rows([layer]) == 1
