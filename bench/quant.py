"""The quantized matmul by number of rows: the default model's 30 decoder layers and its head
read from the GGUF file's own blocks (Q4_1 layers, Q8_0 head) through our kernel
(engine/layers/quant.py, csrc/quant_kernels.c), against the float32 kernel on the same
weights dequantized (csrc/matmul.c: what ``--quantization none`` runs), and against torch's
own weight-only CPU ops on the same layers (``_weight_int8pack_mm``: int8, one scale per
output; ``_weight_int4pack_mm_for_cpu``: int4 in groups of 32 with scales and zeros, which
holds Q4_1 exactly), each row count also checked for batch invariance (a row's bits alone
and in the batch).

    .venv/bin/python -m bench.quant [--repeats 5] [--threads N]

Interleaved, the minimum of the repeats. Writes bench/results/quant.md.
"""

import argparse
import time

import torch

from bench.common import RESULTS, markdown_table, write_report
from engine.worker.gguf_file import checkpoint_tensors
from engine.layers import cpu_kernels, quant
from engine.worker.loader import load_config
from engine.worker.model_store import fetch_default_gguf

ROWS = [1, 2, 4, 8, 16, 32, 64]
MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def weights() -> dict[str, quant.QuantWeight]:
    """Every matrix of the default model's GGUF file, in its blocks (the head: the tied embedding)."""
    path = fetch_default_gguf()
    out = {}
    for name, t in checkpoint_tensors(path, load_config(path)):
        if isinstance(t, quant.QuantTensor):
            out["lm_head" if "embed_tokens" in name else name] = t.weight()
    return out


def int4_pack(w: quant.QuantWeight):
    """A Q4_1 weight as torch's int4 CPU layout: w = (q - 8) * scale + zero, groups of 32."""
    blocks = w.data.view(w.out_features, -1, 20)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)  # [N, K / 32]
    m = blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    q = torch.cat([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], dim=-1).reshape(w.out_features, -1).int()
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed, torch.stack([d.T, (m + 8 * d).T], dim=-1).contiguous()


def int8_pack(w: quant.QuantWeight):
    """torch's int8 weight-only layout: one scale per output row (from the dequantized weight)."""
    f = w.dequantize()
    scale = f.abs().amax(1).clamp_min(1e-12) / 127
    return (f / scale[:, None]).round().to(torch.int8), scale


def runners(ws: dict[str, quant.QuantWeight]) -> dict[str, list]:
    """Per method, one function of x [rows, 576 or 1536] per matrix of a pass (layers then head)."""
    out = {"ours (GGUF blocks)": [], "float32 kernel": [], "torch int8": [], "torch int4": []}
    for name, w in ws.items():
        args = quant.LinearArgs((w,))
        out["ours (GGUF blocks)"].append(lambda x, a=args: quant.linear(x, a))
        kw = cpu_kernels.kernel_weight(w.dequantize())
        out["float32 kernel"].append(lambda x, k=kw: cpu_kernels.matmul(x, k))
        q8, s8 = int8_pack(w)
        out["torch int8"].append(lambda x, q=q8, s=s8: torch._weight_int8pack_mm(x, q, s))
        if w.kind == "Q4_1":
            p4, sz = int4_pack(w)
            out["torch int4"].append(lambda x, p=p4, z=sz: torch._weight_int4pack_mm_for_cpu(x, p, 32, z))
    return out


def invariant(fns: list, inputs: list[torch.Tensor]) -> bool:
    """Whether the last row's result alone has the bits it has in the batch, for the first 8 matrices."""
    return all(torch.equal(f(x)[-1], f(x[-1:])[0]) for f, x in list(zip(fns, inputs))[:8])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ws = weights()
    fns = runners(ws)
    times = {name: {} for name in fns}
    same = {name: True for name in fns}
    for rows in ROWS:
        xs = {k: torch.randn(rows, k) for k in {w.in_features for w in ws.values()}}
        inputs = {name: [xs[w.in_features] for w in ws.values() if name != "torch int4" or w.kind == "Q4_1"]
                  for name in fns}
        for _ in range(args.repeats):
            for name, group in fns.items():
                t = time.perf_counter()
                for f, x in zip(group, inputs[name]):
                    f(x)
                times[name][rows] = min(times[name].get(rows, float("inf")), time.perf_counter() - t)
        for name, group in fns.items():
            same[name] &= rows == 1 or invariant(group, inputs[name])
        print(f"{rows} rows: " + ", ".join(f"{n} {times[n][rows] * 1e3:.2f} ms" for n in fns), flush=True)
    report(times, same, ws, args)


def report(times, same, ws, args) -> None:
    names = list(times)
    rows = [[r] + [times[n][r] * 1e3 for n in names] + [times["float32 kernel"][r] / times[names[0]][r]] for r in ROWS]
    body = markdown_table(["rows"] + [f"{n} ms" for n in names] + ["float32 / ours"], rows)
    body += "\n\n" + markdown_table(["method", "a row's bits independent of the batch"],
                                    [[n, "yes" if same[n] else "no"] for n in names])
    q4 = sum(w.out_features * w.in_features for w in ws.values() if w.kind == "Q4_1")
    body += (f"\n\nOne pass: the default model's {len(ws)} matrices from its GGUF file ({q4 / 1e6:.0f}M weights in "
             "Q4_1, the 28M-weight head in Q8_0; torch int4 runs only the Q4_1 layers, the others every matrix). "
             "The float32 kernel reads the same weights dequantized (4 bytes a weight against 0.625 and 1.06). "
             "Interleaved, minimum of the repeats.")
    threads = f" --threads {args.threads}" if args.threads else ""
    write_report("quant", "Quantized matmul: the default model's GGUF blocks by row count", body,
                 f"python -m bench.quant --repeats {args.repeats}{threads}")
    print((RESULTS / "quant.md").read_text())


if __name__ == "__main__":
    main()
