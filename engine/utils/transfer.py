"""Host-to-device copies of the step's inputs, which the host builds in numpy.

On CUDA an array goes through pinned memory (torch's caching host allocator, which
keeps a block until the copy reading it has run) and is copied without blocking: the
host goes on building the step while the copies run, rather than waiting on one
blocking transfer per input. Elsewhere the array itself is the tensor (no copy).
"""

import numpy as np
import torch


def to_device(data, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (a numpy array or a list) as a tensor on ``device``, in ``dtype`` if given."""
    array = np.ascontiguousarray(data) if isinstance(data, np.ndarray) else np.asarray(data)
    t = torch.as_tensor(array, dtype=dtype, device="cpu")  # staged on the host, then copied
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
