"""Decode attention over the paged KV cache, by context length and rows per request:
what a verification pass's draft chains cost in attention (engine/layers/cpu_kernels.py).

    .venv/bin/python -m bench.attention [--repeats 20]

Times ``cpu_kernels.paged_attention`` over SmolLM2-135M's heads (9 query heads, 3 KV
heads of 64) for 30 layers, with the slots of each request in blocks of 16 spread
over the cache as the block allocator leaves them:

- ``chain``: the metadata the engine builds (``listed=True``): a request's rows share
  its list of slots, each row seeing one key more than the row before;
- ``row by row``: the same rows each given its own copy of the list, so that the
  kernel reads the request's keys once per row (what it did for every chain before
  rows were grouped);
- ``torch``: the reference backend (gathered keys, ``scaled_dot_product_attention``).

Interleaved, the minimum of the repeats. Writes bench/results/attention.md.
"""

import argparse
import dataclasses
import time

import torch

from bench.common import markdown_table, write_report
from engine.attention import SeqSpec, build_attention_metadata, paged_attention
from engine.attention.metadata import ListedQueries
from engine.layers import cpu_kernels

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
CASES = [  # (requests, context, rows per request)
    (1, 256, 1), (1, 1800, 1), (1, 1800, 3), (1, 1800, 9), (1, 1800, 17), (1, 600, 17),
    (16, 300, 1), (16, 1000, 1), (16, 300, 4),
]


def problem(requests: int, context: int, rows: int):
    """(q, k, v, kv cache, specs): ``requests`` requests of ``context`` cached tokens and
    ``rows`` new ones each, their blocks in a random order over the cache."""
    per_request = -(-(context + rows) // BLOCK)
    order = torch.randperm(requests * per_request).tolist()
    specs = [SeqSpec(context, rows, order[i * per_request : (i + 1) * per_request]) for i in range(requests)]
    cache = [torch.randn(requests * per_request, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(2)]
    new = requests * rows
    q, k, v = torch.randn(new, HEADS, HEAD_DIM), torch.randn(new, KV_HEADS, HEAD_DIM), torch.randn(new, KV_HEADS, HEAD_DIM)
    return q, k, v, cache, specs


def row_by_row(meta):
    """The listed metadata with every row given its own copy of its request's list."""
    ls = meta.listed
    lists = [ls.slots[s : s + n] for s, n in zip(ls.start.tolist(), ls.length.tolist())]
    start = torch.tensor([0] + [len(x) for x in lists[:-1]]).cumsum(0)
    return dataclasses.replace(meta, listed=ListedQueries(ls.rows, start, ls.length, torch.cat(lists)))


def time_layers(fn) -> float:
    t = time.perf_counter()
    for _ in range(LAYERS):
        fn()
    return (time.perf_counter() - t) * 1000


@torch.inference_mode()
def measure(case, repeats: int) -> list[float]:
    q, k, v, (k_cache, v_cache), specs = problem(*case)
    listed = build_attention_metadata(specs, BLOCK, listed=True)
    reference = build_attention_metadata(specs, BLOCK)
    separate = row_by_row(listed)
    ways = {
        "chain": lambda: paged_attention(q, k, v, (k_cache, v_cache), listed),
        "row by row": lambda: paged_attention(q, k, v, (k_cache, v_cache), separate),
        "torch": lambda: paged_attention(q, k, v, (k_cache, v_cache), reference),
    }
    best = {name: float("inf") for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            best[name] = min(best[name], time_layers(fn))
    return list(best.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if cpu_kernels.load() is None:
        raise SystemExit("the CPU kernels do not build here (no AVX2/FMA CPU or no C compiler)")
    torch.manual_seed(0)
    rows = []
    for case in CASES:
        chain, separate, reference = measure(case, args.repeats)
        rows.append([*case, chain, separate, reference, separate / chain])
        print(rows[-1], flush=True)
    body = markdown_table(["requests", "context", "rows each", "chain (ms)", "row by row (ms)", "torch (ms)",
                           "row by row / chain"], rows)
    body += (f"\n\nAttention of one pass through the {LAYERS} layers (new keys written, then attended), "
             f"minimum of {args.repeats} interleaved repeats; 9 query heads over 3 KV heads of 64.")
    write_report("attention", "Decode attention over the paged KV cache by context and rows per request", body,
                 f"python -m bench.attention --repeats {args.repeats}")


if __name__ == "__main__":
    main()
