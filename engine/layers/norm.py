import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import cpu_kernels


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32: one C kernel on an
    AVX2 CPU outside autograd (``cpu_kernels.rms_norm``), else torch's fused op.

    ``offset``: the checkpoint stores ``weight - offset`` (Gemma's norms multiply by
    ``1 + w``); the offset is added once, at load."""

    def __init__(self, hidden: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def load(self, shard_id, full, param: str = "weight") -> None:
        """Replicated on every rank; ``full``: a tensor or a lazy safetensors slice."""
        self.weight.data.copy_(full[:])
        if self.offset:
            self.weight.data += self.offset

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, n, D] -> each of the n head vectors normed (the weight is [D]; Qwen3's q/k norms)."""
        return self(x.reshape(-1, x.shape[-1])).view(x.shape)

    def flash(self, rms_norm_fn, x: torch.Tensor, residual: torch.Tensor | None = None):
        """flash-attn's fused norm (``engine.layers.flash_ops``), one kernel: x [T, hidden] ->
        normed x; with ``residual`` [T, hidden], (normed(x + residual), x + residual), the norm
        taken of the float32 sum and the sum returned in residual's dtype."""
        return rms_norm_fn(x, self.weight, None, residual=residual, prenorm=residual is not None, eps=self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if x.dim() == 2 and cpu_kernels.usable(x):
                return cpu_kernels.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        y = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * y.to(x.dtype)
