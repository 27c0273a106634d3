"""Decode attention over the paged KV cache, by context length and rows per request:
what a verification pass's draft chains and trees cost in attention (engine/layers/cpu_kernels.py).

    .venv/bin/python -m bench.attention [--repeats 20] [--baseline CHECKOUT]

Times ``cpu_kernels.paged_attention`` over SmolLM2-135M's heads (9 query heads, 3 KV
heads of 64) for 30 layers, each over its own cache (as in the engine: a step reads
every layer's keys from memory, not one layer's from the last-level cache), with the
slots of each request in blocks of 16 spread over the cache as the block allocator
leaves them:

- ``engine``: the metadata the engine builds (``listed=True``): a chain's rows share
  their request's list of slots, each row seeing one key more than the row before; a
  tree's nodes share one list per root-to-leaf path;
- ``engine, bfloat16 cache``: the same over a bfloat16 copy of the cache
  (``--kv-cache-dtype bfloat16``: half the bytes read);
- ``row by row``: each row given its own copy of the keys it sees, so that the kernel
  reads the request's keys once per row;
- ``torch``: the reference backend (gathered keys, ``scaled_dot_product_attention``);
- where this CPU has AVX-512, ``engine`` through the AVX-512 build of the other CPU vendor
  (``cpu_kernels.AMD``: an item's keys read ahead of its passes, or not) and through the AVX2
  build; with ``--baseline``, through this CPU's build of an older checkout's kernels.

Interleaved, each pass timed after a read of 540 MB (what a decode step of the float32
model reads), which leaves the caches as the engine's attention finds them; the minimum of
the repeats. Writes bench/results/attention.md.
"""

import argparse
import contextlib
import dataclasses
import time
from pathlib import Path

import torch

from bench.common import markdown_table, write_report
from engine.attention import SeqSpec, build_attention_metadata, paged_attention
from engine.utils import tree
from engine.attention.metadata import ListedQueries
from engine.layers import cpu_kernels

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
TWO_BRANCHES = tuple([-1, *range(7)] + [-1, *range(8, 15)])  # two chains of 8 from the same token
BINARY = tree.product_tree([2] * 8, 16)  # 16 nodes, 8 leaves
CASES = [  # (requests, context, new tokens per request: a chain's length or a tree)
    (1, 256, 1), (1, 1800, 1), (1, 1800, 3), (1, 1800, 9), (1, 1800, 17), (1, 600, 17),
    (1, 600, TWO_BRANCHES), (1, 600, BINARY), (1, 1800, TWO_BRANCHES),
    (16, 300, 1), (16, 1000, 1), (16, 300, 4), (64, 500, 1), (64, 500, 3),
]


def problem(requests: int, context: int, new):
    """(q, k, v, a KV cache per layer, specs): ``requests`` requests of ``context`` cached
    tokens and ``new`` new ones each (a count: a chain; else a tree's parents), their blocks in
    a random order over the cache."""
    rows, parents = (new, None) if isinstance(new, int) else (len(new), new)
    per_request = -(-(context + rows) // BLOCK)
    order = torch.randperm(requests * per_request).tolist()
    specs = [SeqSpec(context, rows, order[i * per_request : (i + 1) * per_request], parents) for i in range(requests)]
    caches = [tuple(torch.randn(requests * per_request, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(2))
              for _ in range(LAYERS)]
    new = requests * rows
    q, k, v = torch.randn(new, HEADS, HEAD_DIM), torch.randn(new, KV_HEADS, HEAD_DIM), torch.randn(new, KV_HEADS, HEAD_DIM)
    return q, k, v, caches, specs


def row_by_row(meta):
    """The listed metadata with every row given its own copy of its request's list."""
    ls = meta.listed
    lists = [ls.slots[s : s + n] for s, n in zip(ls.start.tolist(), ls.length.tolist())]
    start = torch.tensor([0] + [len(x) for x in lists[:-1]]).cumsum(0)
    return dataclasses.replace(meta, listed=ListedQueries(ls.rows, start, ls.length, torch.cat(lists)))


EVICT_FLOATS = 135_000_000  # 540 MB: a float32 decode step's weights


@contextlib.contextmanager
def kernels_of(lib):
    """The engine's attention runs the kernels of ``lib`` (None: this CPU's build) inside."""
    load = cpu_kernels.load
    if lib is not None:
        cpu_kernels.load = lambda: lib
    try:
        yield
    finally:
        cpu_kernels.load = load


def time_layers(q, k, v, meta, caches, evict: torch.Tensor, lib=None) -> float:
    """Milliseconds for a pass: attention over ``meta`` in every layer, each over its own cache,
    after a read of ``evict`` (the model's weights in a step: the CPU caches hold none of it),
    through the kernels of ``lib`` (default: this CPU's build)."""
    evict.sum()
    with kernels_of(lib):
        t = time.perf_counter()
        for cache in caches:
            paged_attention(q, k, v, cache, meta)
        return (time.perf_counter() - t) * 1000


def other_builds(baseline: Path | None) -> dict:
    """The extra kernel builds to time the engine's way through, by name: the AVX2 build where
    this CPU's is the AVX-512 one, and this CPU's build of the ``baseline`` checkout."""
    builds = {}
    if baseline is not None:
        builds["baseline"] = cpu_kernels.build(cpu_kernels.compiler(), cpu_kernels.compile_flags(),
                                               baseline / "engine/layers/csrc")
    flags = cpu_kernels.compile_flags()
    if flags != cpu_kernels.FLAGS:  # the AVX-512 build with the read ahead where this one has none, or without
        amd = set(cpu_kernels.AMD) <= set(flags)
        other = cpu_kernels.FLAGS + cpu_kernels.AVX512 + (() if amd else cpu_kernels.AMD)
        builds["AVX-512, no read ahead" if amd else "AVX-512, read ahead"] = cpu_kernels.build(cpu_kernels.compiler(), other)
        builds["AVX2 build"] = cpu_kernels.build(cpu_kernels.compiler(), cpu_kernels.FLAGS)
    return builds


@torch.inference_mode()
def measure(case, repeats: int, builds: dict) -> list[float]:
    q, k, v, caches, specs = problem(*case)
    bf16 = [(kc.bfloat16(), vc.bfloat16()) for kc, vc in caches]
    listed = build_attention_metadata(specs, BLOCK, listed=True)
    ways = {  # name: (metadata, the layers' caches, the kernels' build)
        "engine": (listed, caches, None),
        "engine, bfloat16 cache": (listed, bf16, None),
        "row by row": (row_by_row(listed), caches, None),
        "torch": (build_attention_metadata(specs, BLOCK), caches, None),
        **{name: (listed, caches, lib) for name, lib in builds.items()},
    }
    best = {name: float("inf") for name in ways}
    evict = torch.ones(EVICT_FLOATS)
    for _ in range(repeats):
        for name, (meta, layer_caches, lib) in ways.items():
            best[name] = min(best[name], time_layers(q, k, v, meta, layer_caches, evict, lib))
    return list(best.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout of an older commit: its kernels beside")
    args = ap.parse_args()
    if cpu_kernels.load() is None:
        raise SystemExit("the CPU kernels do not build here (no AVX2/FMA CPU or no C compiler)")
    builds = other_builds(args.baseline)
    torch.manual_seed(0)
    rows = []
    for case in CASES:
        chain, bf16, separate, reference, *others = measure(case, args.repeats, builds)
        requests, context, new = case
        shape = new if isinstance(new, int) else "tree: 2 chains of 8" if new == TWO_BRANCHES else "tree: binary, 16"
        rows.append([requests, context, shape, chain, bf16, bf16 / chain, separate, reference, separate / chain]
                    + [x for t in others for x in (t, t / chain)])
        print(rows[-1], flush=True)
    body = markdown_table(["requests", "context", "new tokens each", "as the engine lists them (ms)",
                           "bfloat16 cache (ms)", "bfloat16 / float32", "row by row (ms)", "torch (ms)",
                           "row by row / engine"] + [x for name in builds for x in (f"{name} (ms)", f"{name} / engine")],
                          rows)
    body += (f"\n\nAttention of one pass through the {LAYERS} layers (new keys written, then attended), "
             f"minimum of {args.repeats} interleaved repeats, each after a 540 MB read that evicts the CPU caches "
             "as a decode step's weights do; 9 query heads over 3 KV heads of 64; "
             "every layer over its own cache, as in the engine.")
    body += (" The bfloat16 cache column reads a bfloat16 copy of the same cache (`--kv-cache-dtype bfloat16`), "
             f"{'AVX-512' if cpu_kernels.compile_flags() != cpu_kernels.FLAGS else 'AVX2'} build.")
    if "AVX2 build" in builds:
        body += (" The AVX-512 read ahead column: the engine's lists through the AVX-512 build of the other CPU vendor "
                 "(an item's keys and values read ahead of its passes on an AMD CPU, not on an Intel one); the AVX2 "
                 "build column: through the AVX2 build (`SPECSERVE_CPU_AVX512=0`).")
    if args.baseline is not None:
        body += f" The baseline column: the engine's lists through this CPU's build of the checkout at `{args.baseline}`."
    baseline = f" --baseline {args.baseline}" if args.baseline else ""
    write_report("attention", "Decode attention over the paged KV cache by context and rows per request", body,
                 f"python -m bench.attention --repeats {args.repeats}{baseline}")


if __name__ == "__main__":
    main()
