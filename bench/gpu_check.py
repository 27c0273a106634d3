"""The prepared device check: one command on a GPU machine, a Markdown report (and a PNG).

    python -m bench.gpu_check --out DIR                    # CUDA; under 5 minutes on one H200
    python -m bench.gpu_check --out DIR --tiny --device cpu  # the same script, small, on the CPU

Written for a machine with torch (CUDA) and Triton, maybe without flash-attn and
without network; the project's Python dependencies (transformers, numpy, ...) must
import. Every section runs on its own: a failure is reported and the next one
runs. Sections:

1. environment, and the attention backend ``auto`` picks here;
2. the ``gpu``-marked tests (``tests/gpu``), in a pytest subprocess;
3. every backend that runs here against the float64 dense reference, with and
   without trees, in the serving dtype (bf16 on CUDA) and in float32;
4. greedy equality in float32 on a tiny model: each backend gives the torch
   backend's tokens, plain and with ngram draft chains;
5. end-to-end decode tokens/s of the tiny model and, when it is on disk, of the
   default model (SmolLM2-135M-Instruct), per backend;
6. CUDA only: Llama-3-8B shapes (random weights, bf16): the cost of a pass over
   1, 2, 4, 8, 16 tokens per request and over a 16-node tree relative to a
   decode step at batch 1, 8, 32, and decode tokens/s against the HBM roofline (the
   weights a step reads, the embedding table but its rows excepted, and the KV);
7. the paths that crashed before their first CUDA run (``bench.gpu_paths``): a Llama 3
   rope checkpoint, logprobs under speculation, a drafter on the device, and
   tensor parallelism when two GPUs are visible.
"""

import argparse
import gc
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.common import ROOT, markdown_table, repetitive_prompts, tiny_model
from bench.gpu_paths import cuda_paths
from engine.attention.backends import BACKENDS, flash_attn_installed, select_backend

HBM_BYTES_PER_S = 4.8e12  # H200
BUDGET_S = 270  # sections that would start later are skipped: the check stays under 5 minutes
TREE16 = (-1, 0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 10)  # 16 nodes: 3 children of the root, then chains


def runnable_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    out = []
    for name in BACKENDS:
        try:
            select_backend(name, device, dtype)
            out.append(name)
        except ValueError:
            pass
    return out


def environment(args) -> str:
    rows = [["torch", torch.__version__], ["CUDA (torch build)", torch.version.cuda or "none"],
            ["device", torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"],
            ["flash-attn installed", flash_attn_installed()],
            ["auto backend (serving dtype)", select_backend("auto", args.device, args.dtype).name]]
    for mod in ("triton", "transformers", "pytest"):
        try:
            rows.append([mod, __import__(mod).__version__])
        except ImportError:
            rows.append([mod, "not installed"])
    return markdown_table(["what", "value"], rows)


def gpu_tests(args) -> str:
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--noconftest"]  # tests/gpu needs no fixture; the suite's conftest would add imports that may be missing
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-25:])
    if r.returncode not in (0, 5):  # 5: nothing collected
        raise AssertionError(f"pytest exited {r.returncode}\n```\n{tail}\n```")
    return f"`{' '.join(cmd[1:])}` exited {r.returncode}:\n\n```\n{tail}\n```"


def backends_vs_reference(args) -> str:
    from engine.attention import paged_attention
    from bench.attention_problems import make_problem

    rows, worst = [], []
    for dtype in dict.fromkeys([args.dtype, torch.float32]):
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        for name in runnable_backends(args.device, dtype):
            backend = BACKENDS[name]
            block = backend.block_size(4)
            heads = dict(num_heads=4, head_dim=8) if args.tiny else dict(num_heads=8, head_dim=64)
            pb = make_problem(block_size=block, dtype=dtype, device=args.device, num_kv_heads=2, **heads)
            meta = backend.build_metadata(pb.specs, block, args.device)
            out = paged_attention(pb.q, pb.k, pb.v, (pb.k_cache, pb.v_cache), meta)
            err = (out.double().cpu() - pb.reference).abs().max().item()
            rows.append([name, str(dtype).removeprefix("torch."), f"{err:.2e}", f"{tol:.0e}", "ok" if err <= tol else "FAIL"])
            worst.append(err <= tol)
    table = markdown_table(["backend", "dtype", "max abs error", "tolerance", ""], rows)
    assert all(worst), "a backend is off the reference:\n\n" + table
    shape = "GQA 4/2 heads, D 8" if args.tiny else "GQA 8/2 heads, D 64"
    return f"Requests: prefills, chunks, decodes, chains, trees (one with no context), {shape}.\n\n" + table


def engine_for(model, args, backend: str, dtype: torch.dtype, speculative=None, num_blocks=256):
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
    from engine.llm_engine import LLMEngine

    dtype_name = str(dtype).removeprefix("torch.")
    config = EngineConfig(
        ModelConfig(device=str(args.device), dtype=dtype_name, attention_backend=backend, max_model_len=512),
        CacheConfig(num_blocks=num_blocks), SchedulerConfig(max_num_batched_tokens=256),
        speculative or SpeculativeConfig(),
    )
    return LLMEngine(config, model=model)


def generate(engine, prompts, max_tokens) -> list[list[int]]:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


def greedy_equality(args) -> str:
    from engine.config import SpeculativeConfig

    model = tiny_model(args.device, torch.float32)
    n, max_tokens = (3, 12) if args.tiny else (6, 24)
    prompts = repetitive_prompts(n, 512)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, verify_cost=0.1)
    ref = generate(engine_for(model, args, "torch", torch.float32), prompts, max_tokens)
    rows, ok = [], True
    for name in runnable_backends(args.device, torch.float32):
        for label, spec in (("plain", None), ("ngram chains", ngram)):
            got = generate(engine_for(model, args, name, torch.float32, spec), prompts, max_tokens)
            same = sum(a == b for a, b in zip(got, ref))
            ok &= same == len(ref)
            rows.append([name, label, f"{same}/{len(ref)}"])
    table = markdown_table(["backend", "decoding", "requests equal to torch plain greedy"], rows)
    assert ok, table
    return f"Tiny random Llama, float32, {n} requests x {max_tokens} greedy tokens.\n\n" + table


def tokens_per_s(engine, batch: int, max_tokens: int) -> float:
    prompts = repetitive_prompts(batch, engine.model.config.vocab_size)
    generate(engine, prompts[:1], 4)  # warm-up
    t = time.perf_counter()
    generate(engine, prompts, max_tokens)
    return batch * max_tokens / (time.perf_counter() - t)


def throughput(args) -> str:
    from engine.worker.model_store import default_model_dir

    rows = []
    tiny = tiny_model(args.device, args.dtype)
    for name in runnable_backends(args.device, args.dtype):
        tps = tokens_per_s(engine_for(tiny, args, name, args.dtype), 8, 8 if args.tiny else 64)
        rows.append(["tiny (2 layers)", name, 8, f"{tps:.0f}"])
    path = default_model_dir()
    if args.tiny or not path.exists():
        why = "not run with --tiny" if args.tiny else f"not on disk ({path})"
        return markdown_table(["model", "backend", "batch", "tokens/s"], rows) + f"\n\nDefault model: {why}."
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine

    for name in runnable_backends(args.device, args.dtype):
        dtype_name = str(args.dtype).removeprefix("torch.")
        config = EngineConfig(  # on CUDA, KV blocks from a profiled --gpu-memory-utilization (engine.worker.gpu_memory)
            ModelConfig(model=str(path), device=str(args.device), dtype=dtype_name, attention_backend=name, max_model_len=1024),
            CacheConfig(gpu_memory_utilization=0.3, memory_bytes=1 << 28), SchedulerConfig(max_num_batched_tokens=512),
        )
        engine = LLMEngine(config)
        for batch in args.batches:
            tps = tokens_per_s(engine, batch, 32 if args.tiny else 64)
            rows.append([f"SmolLM2-135M ({engine.kv_manager.pool.num_blocks} KV blocks)", name, batch, f"{tps:.0f}"])
        del engine  # and its KV cache, before the next engine profiles the GPU's memory
        gc.collect()
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    table = markdown_table(["model", "backend", "batch", "tokens/s"], rows)
    return table + "\n\nEnd to end through the engine (prefill included)."


def llama8b(args, plot_path: Path) -> str:
    from bench.verify_cost import LLAMA_8B, TINY, build, measure

    shapes = TINY if args.tiny else LLAMA_8B
    tokens, context, repeats = [1, 2, 4, 8, 16], (64 if args.tiny else 512), (1 if args.tiny else 8)
    model = build(shapes, args.device, args.dtype, context + 17)
    # A decode step reads every weight but the embedding table (only its rows), and each request's KV.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    read_bytes = weight_bytes - model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    attn = model.layers[0].self_attn
    kv_bytes = 2 * len(model.layers) * attn.num_kv_heads * attn.head_dim * args.dtype.itemsize * context  # a request's
    names = dict.fromkeys(["torch", select_backend("auto", args.device, args.dtype).name])
    parts, curves = [], {}
    for name in names:
        backend = BACKENDS[name]
        ms = measure(shapes, args.device, args.dtype, args.batches, tokens, context, repeats, backend, model=model)
        tree = _tree_ms(model, args, backend, context, repeats)
        header = ["batch", "decode ms", "tok/s", "roofline %"] + [f"{n} tok x" for n in tokens[1:]] + ["tree16 x"]
        rows = []
        for b in args.batches:
            roof = b * HBM_BYTES_PER_S / (read_bytes + b * kv_bytes)  # tokens/s when the step is all reads
            rows.append([b, f"{ms[b][1]:.2f}", f"{b * 1000 / ms[b][1]:.0f}", f"{100 * b * 1000 / ms[b][1] / roof:.0f}"]
                        + [f"{ms[b][n] / ms[b][1]:.2f}" for n in tokens[1:]] + [f"{tree[b] / ms[b][1]:.2f}"])
            curves[(name, b)] = [ms[b][n] / ms[b][1] for n in tokens]
        parts.append(f"**{name}**\n\n" + markdown_table(header, rows))
    _plot(curves, tokens, plot_path)
    what = "tiny config (smoke run)" if args.tiny else "Llama-3-8B shapes, random weights"
    return (f"{what}, {str(args.dtype).removeprefix('torch.')}, {weight_bytes / 1e9:.1f} GB of weights, {context} tokens "
            f"of context; roofline = batch x {HBM_BYTES_PER_S / 1e12:.1f} TB/s / (bytes of the weights but the embedding "
            f"+ batch x {kv_bytes / 1e6:.1f} MB of KV a request); 'n tok x' = a pass over n "
            f"tokens per request in decode steps; targets: batch-1 roofline >= 70 %, 8 tok x <= 1.1 and tree16 x <= 1.15 "
            f"at batch 1, 4 tok x <= 1.5 at batch 32.\n\n" + "\n\n".join(parts))


def _tree_ms(model, args, backend, context, repeats) -> dict:
    from bench.verify_cost import BLOCK, pass_ms
    from engine.models.decoder import head_dim_of
    from kvcache.tensors import KVSpec, PagedKV

    cfg, block = model.config, backend.block_size(BLOCK)
    spec = KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), block, args.dtype)
    kv = PagedKV(spec, max(args.batches) * -(-(context + 16) // block), args.device)
    return {b: pass_ms(model, kv, b, 16, context, repeats, backend, TREE16) for b in args.batches}


def _plot(curves: dict, tokens: list[int], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, b), ys in curves.items():
        ax.plot(tokens, ys, marker="o", label=f"{name}, batch {b}")
    ax.set(xscale="log", xlabel="tokens per request in the pass", ylabel="cost in decode steps", xticks=tokens)
    ax.set_xticklabels([str(t) for t in tokens])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_check.md and gpu_check.png")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes (the CPU smoke run)")
    ap.add_argument("--skip", nargs="*", default=[], help="section names to skip")
    args = ap.parse_args(argv)
    args.device = torch.device(args.device)
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    args.batches = [1, 8, 32] if not args.tiny else [1, 8]
    args.out.mkdir(parents=True, exist_ok=True)
    sections = [("environment", environment), ("gpu tests", gpu_tests), ("backends vs reference", backends_vs_reference),
                ("greedy equality", greedy_equality), ("CUDA paths", cuda_paths), ("throughput", throughput),
                ("Llama-3-8B shapes", lambda a: llama8b(a, args.out / "gpu_check.png"))]
    start, results, body = time.perf_counter(), {}, []
    for name, fn in sections:
        t = time.perf_counter()
        if name in args.skip or t - start > BUDGET_S:
            status, text = "SKIPPED", "skipped (--skip)" if name in args.skip else "skipped: out of the time budget"
        else:
            try:
                status, text = "PASS", fn(args)
            except Exception:  # noqa: BLE001 - one failing section must not hide the others
                status, text = "FAIL", "```\n" + traceback.format_exc()[-3000:] + "\n```"
        results[name] = status
        body.append(f"## {name}: {status} ({time.perf_counter() - t:.0f} s)\n\n{text}")
        print(f"{name}: {status}", flush=True)
    head = (f"# specserve device check\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"`python -m bench.gpu_check {' '.join(argv if argv is not None else sys.argv[1:])}`; "
            f"{time.perf_counter() - start:.0f} s in all.\n\n")
    (args.out / "gpu_check.md").write_text(head + "\n\n".join(body) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(0 if "FAIL" not in main().values() else 1)
