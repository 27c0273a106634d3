"""The image build's check that flash-attn is there and works with this torch.

    python deploy/flash_attn_check.py   # exit status 0: flash-attn loads and its kernels run

A docker build has no GPU, so the tiny call is one the compiled module answers
without one: ``varlen_fwd`` on CPU tensors must fail inside flash-attn's own C++
(its device guard or its argument checks), not at loading. A wheel built for another
torch or CUDA fails before: ``undefined symbol`` when ``flash_attn_2_cuda`` loads.
Then the engine must see it as usable (``engine.attention.backends.flash_attn_status``).
"""

import sys


def check() -> str:
    """What was found; raises with the reason when flash-attn would not serve."""
    import torch

    import flash_attn
    import flash_attn_2_cuda  # the compiled kernels: loading is where a mismatched wheel fails

    q = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    try:
        flash_attn_2_cuda.varlen_fwd(q, q, q, None, cu, cu, None, None, None, None, 1, 1, 0.0, 1.0, False, False,
                                     -1, -1, 0.0, False, None)
    except RuntimeError as e:  # expected: CPU tensors; proves the kernel entry ran
        said = str(e).splitlines()[0]
    else:
        raise AssertionError("flash_attn_2_cuda.varlen_fwd took CPU tensors")
    from engine.attention.backends import flash_attn_status

    status = flash_attn_status()
    if status is not None:
        raise AssertionError(f"the engine would not use flash-attn: {status}")
    return f"flash-attn {flash_attn.__version__} loads with torch {torch.__version__} (CUDA {torch.version.cuda}); " \
           f"varlen_fwd on CPU tensors: {said}"


if __name__ == "__main__":
    print(check())
    sys.exit(0)
