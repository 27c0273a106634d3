"""The gated MLP of the dense decoders, and the expert of the sparse ones (``engine.models.moe``)."""

import torch.nn.functional as F
from torch import nn

from engine.layers import cpu_kernels
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.parallel import TPGroup


class LlamaMLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)). ``reduce=False`` leaves the tensor-parallel
    sum to the caller (an expert of ``SparseMoE``)."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup, activation: str = "silu", bias: bool = False,
                 reduce: bool = True):
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"MLP activation {activation!r} is not supported (silu, gelu_tanh)")
        part = tp.split(intermediate, "intermediate_size")  # this rank's (first unit, units)
        self.activation = activation
        self.gate_up_proj = ColumnParallelLinear(hidden, None, tp, parts=[part, part], bias=bias,
                                                 full_sizes=[intermediate, intermediate])
        self.down_proj = RowParallelLinear(intermediate, hidden, tp, part, bias=bias, reduce=reduce)

    def forward(self, x, swiglu=None):
        """x [T, hidden] -> [T, hidden]; ``swiglu``: flash-attn's fused SiLU * up (``flash_ops``), or None."""
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if self.activation == "silu" and cpu_kernels.usable(gate_up):
            return self.down_proj(cpu_kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        if swiglu is not None and self.activation == "silu":
            return self.down_proj(swiglu(gate, up))  # one kernel
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(act * up)
