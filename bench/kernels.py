"""The CPU matmul kernels of a pass, by number of tokens: what a step's rows cost through
our C kernel (engine/layers/cpu_kernels.py, csrc/matmul.c), which runs every row count
so that a token's bits never depend on its step, against oneDNN, which the torch path
(``SPECSERVE_CPU_KERNELS=0``) uses.

    .venv/bin/python -m bench.kernels [--repeats 7] [--baseline CHECKOUT]

Runs the linear layers of the default model's 30 decoder layers (SmolLM2-135M shapes,
random fp32 weights: speed does not depend on their values) over 1 to 256 rows with
oneDNN (weights prepacked with a batch-size hint of 16, as the torch path does) and with
``cpu_kernels.matmul`` (where it builds: the build for this CPU, and on an AVX-512 CPU
the AVX-512 build of the other few-rows stream count and the AVX2-only build too; with
``--baseline``, this CPU's build of an older checkout's kernels beside them); interleaved,
the minimum of the repeats. Beside them, the time
the machine takes just to read the weights once (``stream_read.c``): the floor a decode
step cannot go under.
Writes bench/results/kernels.md and kernels.png.
"""

import argparse
import ctypes
import time
from pathlib import Path

import torch

from bench.common import RESULTS, markdown_table, write_report
from engine.layers import cpu_kernels

LAYERS = 30
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate_up, down
ROWS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256]
ONEDNN = "oneDNN"


def layer_stack(lib=None):
    """Per layer, the four matmuls as functions of x [rows, in]: oneDNN prepacked with a hint of
    16 (``lib`` None) or the C kernel of the library ``lib``."""
    stack = []
    for _ in range(LAYERS):
        fns = []
        for d_in, d_out in SHAPES:
            w = torch.randn(d_out, d_in)
            if lib is None:
                p = torch.ops.mkldnn._reorder_linear_weight(w, 16)
                fns.append(lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
            else:
                fns.append(lambda x, w=cpu_kernels.kernel_weight(w, lib): matmul(lib, x, w))
        stack.append(fns)
    return stack


def matmul(lib, x, w: cpu_kernels.KernelWeight):
    y = torch.empty(x.shape[0], w.out_features)
    lib.matmul_f32(x.data_ptr(), w.data.data_ptr(), y.data_ptr(), x.shape[0], w.out_features, x.shape[1],
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


def read_floor_ms(repeats: int) -> float | None:
    """Milliseconds to read the 30 layers' weights once at the machine's streaming speed from
    memory (2 GiB read, more than any last-level cache holds; the minimum of ``repeats``), or
    None without the C kernels' compiler and CPU."""
    if cpu_kernels.load() is None:
        return None
    path = cpu_kernels.compile_library("stream_read", [Path(__file__).with_name("stream_read.c")],
                                       cpu_kernels.compiler(), cpu_kernels.FLAGS)
    fn = ctypes.CDLL(str(path)).stream_read_f32
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int], ctypes.c_float
    n = 1 << 29  # floats: 2 GiB
    a = torch.ones(n + 16)
    start = a[(-a.data_ptr() // 4) % 16:][:n]  # 64-byte aligned
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(start.data_ptr(), n, torch.get_num_threads())
        best = min(best, time.perf_counter() - t)
    return best * 1000 * LAYERS * sum(i * o for i, o in SHAPES) / n


def kernels(baseline: Path | None = None) -> dict[str, list]:
    """The stacks to time, by name: oneDNN and each C kernel build this CPU can run (this CPU's
    build of the ``baseline`` checkout's kernels too, where given)."""
    stacks = {ONEDNN: layer_stack()}
    lib = cpu_kernels.load()
    if lib is not None:
        flags = cpu_kernels.compile_flags()
        build = "AVX-512" if flags != cpu_kernels.FLAGS else "AVX2"
        stacks[f"C kernel, {build}"] = layer_stack(lib)
        if baseline is not None:
            old = cpu_kernels.build(cpu_kernels.compiler(), flags, baseline / "engine/layers/csrc")
            stacks[f"C kernel, {build}, baseline"] = layer_stack(old)
        if build == "AVX-512":  # the other stream count of the few-rows matmul (csrc/matmul.c), and the AVX2 build
            streams = set(cpu_kernels.AMD) <= set(flags)
            other = cpu_kernels.FLAGS + cpu_kernels.AVX512 + (() if streams else cpu_kernels.AMD)
            stacks[f"C kernel, AVX-512, {'1 stream' if streams else '4 streams'}"] = layer_stack(
                cpu_kernels.build(cpu_kernels.compiler(), other))
            stacks["C kernel, AVX2"] = layer_stack(cpu_kernels.build(cpu_kernels.compiler(), cpu_kernels.FLAGS))
    return stacks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout of an older commit: its kernels beside")
    args = ap.parse_args()
    stacks = kernels(args.baseline)
    best = {(k, r): float("inf") for k in stacks for r in ROWS}
    for _ in range(args.repeats):
        for r in ROWS:
            for name, stack in stacks.items():
                best[name, r] = min(best[name, r], time_pass(stack, r))
    floor = read_floor_ms(args.repeats)
    c_names = [k for k in stacks if k != ONEDNN]
    header = ["tokens"] + [f"{k} (ms)" for k in stacks] + [f"{k}: cost / 1 token" for k in c_names]
    header += [f"{k} / oneDNN" for k in c_names[:1]]  # this CPU's build
    rows = [[r] + [best[k, r] for k in stacks] + [best[k, r] / best[k, 1] for k in c_names]
            + [best[k, r] / best[ONEDNN, r] for k in c_names[:1]] for r in ROWS]
    body = markdown_table(header, rows)
    body += ("\n\nThe matmuls of one pass through the 30 decoder layers (the output head excluded), "
             f"minimum of {args.repeats} interleaved repeats. The C kernel runs every row count in the "
             "engine (one chain over k per output: a token's bits never depend on its step); oneDNN "
             "runs them with `SPECSERVE_CPU_KERNELS=0`.")
    if floor is not None:
        weights_mb = LAYERS * sum(i * o for i, o in SHAPES) * 4 / 1e6
        body += (f"\n\nReading the {weights_mb:.0f} MB of these weights once, at this machine's streaming read speed "
                 f"(`bench/stream_read.c`, {torch.get_num_threads()} threads), takes {floor:.2f} ms "
                 f"({weights_mb / floor:.1f} GB/s): the floor under a decode step's matmuls. "
                 + "; ".join(f"{k} at 1 token: {floor / best[k, 1]:.2f} of that speed" for k in c_names) + ".")
    if args.baseline is not None:
        body += f"\n\nThe baseline column: this CPU's build of the kernels of the checkout at `{args.baseline}`."
    baseline = f" --baseline {args.baseline}" if args.baseline else ""
    write_report("kernels", "CPU matmul kernels by tokens in a pass (SmolLM2-135M shapes, fp32)", body,
                 f"python -m bench.kernels --repeats {args.repeats}{baseline}")
    plot(stacks, best)


def plot(stacks, best) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in stacks:
        ax.plot(ROWS, [best[name, r] for r in ROWS], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the pass")
    ax.set_ylabel("ms for the 30 layers' matmuls")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "kernels.png", dpi=100)


if __name__ == "__main__":
    main()
