"""flash-attn's fused kernels for the decoder on the flash_attn backend: one launch each
where torch launches several (docs/gpu.md, "Launches").

- ``rms_norm_fn`` (Triton): an RMS norm, or the residual add and the norm of the sum;
- ``apply_rotary`` (Triton): rope on queries and keys together, GPT-NeoX halves;
- ``swiglu`` (jiterator): SiLU(gate) * up.

Each computes in float32 and rounds once, where the torch path rounds after each op:
the two agree within bf16's tolerance, not in bits. The CPU and the other backends keep
the torch and C paths.
"""

import functools
import logging
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlashOps:
    rms_norm_fn: Callable  # flash_attn.ops.triton.layer_norm.rms_norm_fn
    apply_rotary: Callable  # flash_attn.ops.triton.rotary.apply_rotary
    swiglu: Callable  # flash_attn.ops.activations.swiglu


@functools.cache
def load() -> FlashOps | None:
    """flash-attn's fused ops, or None where they do not import (no Triton, an older flash-attn)."""
    try:
        from flash_attn.ops.activations import swiglu
        from flash_attn.ops.triton.layer_norm import rms_norm_fn
        from flash_attn.ops.triton.rotary import apply_rotary
    except Exception as e:  # noqa: BLE001 - ImportError, a Triton that does not load: the torch path then
        log.warning("flash-attn's fused ops do not load (%s: %s): the layers run torch's ops", type(e).__name__, e)
        return None
    return FlashOps(rms_norm_fn, apply_rotary, swiglu)
