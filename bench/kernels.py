"""The CPU matmul kernels of a pass, by number of tokens: why weights are prepacked
for oneDNN with a batch-size hint of 16, and why a few rows go through our own
C kernel instead (engine/layers/linear.py, engine/layers/cpu_kernels.py).

    .venv/bin/python -m bench.kernels [--repeats 7]

Runs the linear layers of the default model's 30 decoder layers (SmolLM2-135M
shapes, random fp32 weights: speed does not depend on their values) over 1 to
32 rows with oneDNN weights prepacked with hint 1 and with hint 16, with
``F.linear`` on the plain weights, and with ``cpu_kernels.gemv`` (where it
builds: the build for this CPU, and on an AVX-512 CPU the AVX2-only build
too); interleaved, the minimum of the repeats.
Writes bench/results/kernels.md and kernels.png.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from bench.common import RESULTS, markdown_table, write_report
from engine.layers import cpu_kernels

LAYERS = 30
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate_up, down
ROWS = [1, 2, 3, 4, 6, 8, 11, 16, 17, 24, 32]


def layer_stack(hint, lib=None):
    """Per layer, the four matmuls as functions of x [rows, in]: oneDNN prepacked with
    ``hint``, ``F.linear`` (None) or the C kernel ("gemv", of the library ``lib``, default
    this CPU's build)."""
    stack = []
    for _ in range(LAYERS):
        fns = []
        for d_in, d_out in SHAPES:
            w = torch.randn(d_out, d_in)
            if hint is None:
                fns.append(lambda x, w=w: F.linear(x, w))
            elif hint == "gemv":
                fns.append(lambda x, w=cpu_kernels.kernel_weight(w, lib): gemv(lib, x, w))
            else:
                p = torch.ops.mkldnn._reorder_linear_weight(w, hint)
                fns.append(lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
        stack.append(fns)
    return stack


def gemv(lib, x, w: cpu_kernels.KernelWeight):
    if lib is None:
        return cpu_kernels.gemv(x, w)
    y = torch.empty(x.shape[0], w.out_features)
    lib.gemv_f32(x.data_ptr(), w.data.data_ptr(), y.data_ptr(), x.shape[0], w.out_features, x.shape[1],
                 torch.get_num_threads())
    return y


def time_pass(stack, rows: int) -> float:
    """Milliseconds for every matmul of the 30 layers over ``rows`` tokens."""
    xs = [torch.randn(rows, d_in) for d_in, _ in SHAPES]
    t = time.perf_counter()
    for fns in stack:
        for f, x in zip(fns, xs):
            f(x)
    return (time.perf_counter() - t) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    kernels = {"oneDNN, hint 1": layer_stack(1), "oneDNN, hint 16": layer_stack(16), "F.linear": layer_stack(None)}
    if cpu_kernels.load() is not None:
        avx512 = cpu_kernels.compile_flags() != cpu_kernels.FLAGS
        kernels["C kernel, AVX-512" if avx512 else "C kernel, AVX2"] = layer_stack("gemv")
        if avx512:
            avx2 = cpu_kernels.build(cpu_kernels.compiler(), cpu_kernels.FLAGS)
            kernels["C kernel, AVX2"] = layer_stack("gemv", avx2)
    best = {(k, r): float("inf") for k in kernels for r in ROWS}
    for _ in range(args.repeats):
        for r in ROWS:
            for name, stack in kernels.items():
                best[name, r] = min(best[name, r], time_pass(stack, r))
    rows = [[r] + [best[k, r] for k in kernels] + [best["oneDNN, hint 16", r] / best["oneDNN, hint 16", 1]] for r in ROWS]
    body = markdown_table(["tokens"] + [f"{k} (ms)" for k in kernels] + ["hint 16: cost / 1 token"], rows)
    body += ("\n\nThe matmuls of one pass through the 30 decoder layers (the output head excluded), "
             f"minimum of {args.repeats} interleaved repeats.")
    write_report("kernels", "CPU matmul kernels by tokens in a pass (SmolLM2-135M shapes, fp32)", body,
                 f"python -m bench.kernels --repeats {args.repeats}")
    plot(kernels, best)


def plot(kernels, best) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in kernels:
        ax.plot(ROWS, [best[name, r] for r in ROWS], "o-", label=name)
    ax.set_xlabel("tokens in the pass")
    ax.set_ylabel("ms for the 30 layers' matmuls")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "kernels.png", dpi=100)


if __name__ == "__main__":
    main()
