"""The cost of a verification pass by tokens per request, relative to a plain decode step.
On the engine's own model and paged attention, with random weights (speed does not
depend on their values).

    python -m bench.verify_cost            # CUDA, bfloat16, Llama-3-8B shapes (~17 GB of weights)
    python -m bench.verify_cost --tiny     # a small config on the CPU: a smoke run

For each batch size B (1, 8, 32), every request has ``--context`` tokens in the
KV cache, and a pass computes n = 1, 2, 4, 8, 16 new tokens per request with
logits for every row: n = 1 is a plain decode step, n = 1 + g the verification
of g drafts. Median of ``--repeats`` synchronized passes after warm-up.
Writes bench/results/verify_cost.md.
"""

import argparse
import statistics
import time
from contextlib import contextmanager

import torch
from transformers import LlamaConfig

from bench.common import markdown_table, write_report
from engine.attention import AttentionBackend, SeqSpec
from engine.attention.backends import TORCH
from engine.models.decoder import LlamaForCausalLM, head_dim_of
from kvcache.tensors import KVSpec, PagedKV

LLAMA_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
)
BLOCK = 16


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build(shapes: dict, device: torch.device, dtype: torch.dtype, max_positions: int) -> LlamaForCausalLM:
    """The model, built in place on ``device`` and ``dtype``, with small random weights."""
    cfg = LlamaConfig(max_position_embeddings=max_positions, **shapes)
    with torch.device(device), default_dtype(dtype):
        model = LlamaForCausalLM(cfg, max_positions=max_positions)
    for name, p in model.named_parameters():
        torch.nn.init.ones_(p) if "norm" in name else torch.nn.init.normal_(p, std=0.02)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def pass_ms(model, kv: PagedKV, batch: int, n: int, context: int, repeats: int, backend: AttentionBackend = TORCH,
            parents: tuple[int, ...] | None = None) -> float:
    """Median milliseconds of one pass over ``n`` new tokens for each of ``batch`` requests
    (a tree over them with ``parents``; default a chain)."""
    device, block = kv.k[0].device, kv.spec.block_size
    per_request = -(-(context + n) // block)
    specs = [SeqSpec(context, n, list(range(b * per_request, (b + 1) * per_request)), parents) for b in range(batch)]
    meta = backend.build_metadata(specs, block, device)
    ids = torch.randint(0, model.config.vocab_size, (batch * n,), device=device)
    pos = torch.arange(context, context + n, device=device).repeat(batch)  # [batch * n]
    times = []
    for i in range(repeats + 3):  # three warm-up passes
        sync(device)
        t = time.perf_counter()
        model.compute_logits(model(ids, pos, meta, kv)).argmax(-1)
        sync(device)
        if i >= 3:
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def measure(shapes: dict, device, dtype, batches, tokens, context: int, repeats: int, backend: AttentionBackend = TORCH,
            model=None) -> dict:
    """{batch: {n: ms}} for every batch size and tokens per request (``model``: built if None)."""
    model = model or build(shapes, device, dtype, context + max(tokens) + 1)
    cfg = model.config
    block = backend.block_size(BLOCK)
    num_blocks = max(batches) * -(-(context + max(tokens)) // block)
    kv = PagedKV(KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), block, dtype), num_blocks, device)
    return {b: {n: pass_ms(model, kv, b, n, context, repeats, backend) for n in tokens} for b in batches}


def table(results: dict) -> str:
    tokens = list(next(iter(results.values())))
    header = ["batch"] + [f"{n} tok/req: ms (x step)" for n in tokens]
    rows = [[b] + [f"{ms[n]:.2f} ({ms[n] / ms[tokens[0]]:.2f})" for n in tokens] for b, ms in results.items()]
    return markdown_table(header, rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a small config on the CPU, in float32")
    ap.add_argument("--context", type=int, default=512, help="tokens already in each request's KV cache")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    args = ap.parse_args(argv)
    if args.tiny:
        shapes, device, dtype, what = TINY, torch.device("cpu"), torch.float32, "tiny Llama, CPU, float32"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --tiny for a CPU smoke run")
        shapes, device, dtype = LLAMA_8B, torch.device("cuda"), torch.bfloat16
        what = f"Llama-3-8B shapes, random weights, bfloat16, {torch.cuda.get_device_name(device)}"
    results = measure(shapes, device, dtype, [1, 8, 32], [1, 2, 4, 8, 16], args.context, args.repeats)
    body = (f"{what}; {args.context} tokens of context per request; median of {args.repeats} passes. "
            "Each cell: milliseconds of one pass over n new tokens per request, with logits for every row, "
            "and in brackets its cost in plain decode steps (n = 1) at the same batch.\n\n" + table(results))
    print(body)
    if not args.no_write:
        cmd = "python -m bench.verify_cost" + (" --tiny" if args.tiny else "")
        write_report("verify_cost", "Verification pass cost by tokens per request", body, cmd)
    return results


if __name__ == "__main__":
    main()
