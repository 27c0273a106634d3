"""Plain decoding throughput, side by side with transformers' generate.

    .venv/bin/python -m bench.plain [--new-tokens 128] [--prompts 4]

Batch 1: tokens/s per prompt (prompt processing included) on chat prompts and
copy-heavy prompts (Spec-Bench summarization and rag). Concurrency 1, 4 and 16:
total tokens/s. Each measurement runs transformers and specserve back to back
on the same model, dtype and prompts, so their ratio is robust to the noise of
a shared machine. Writes bench/results/plain.md and plain.png.
"""

import argparse
import statistics
import time

import torch

from bench.common import RESULTS, chat_prompts, markdown_table, render_chat, spec_bench, write_report
from engine import LLM, SamplingParams


def hf_generate(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for transformers' greedy generate of exactly ``new_tokens`` per prompt (left-padded batch)."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=pad,
        )
    return time.perf_counter() - t


def ours(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per group at batch 1")
    ap.add_argument("--concurrency", default="1,4,16")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    llm = LLM(max_model_len=4096)
    tok = llm.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=torch.float32).eval()
    n = args.new_tokens
    groups = {
        "chat": chat_prompts(args.prompts),
        "copy-heavy": (spec_bench("summarization", 2) + spec_bench("rag", 2))[: args.prompts],
    }
    ours(llm, [render_chat(tok, "Hello")], 8)  # warm-up
    hf_generate(hf, tok, [render_chat(tok, "Hello")], 8)
    rows, batch1 = [], {}
    for group, texts in groups.items():
        hf_rates, our_rates = [], []
        for text in texts:
            ids = render_chat(tok, text)
            hf_rates.append(n / hf_generate(hf, tok, [ids], n))
            our_rates.append(n / ours(llm, [ids], n))
        h, o = statistics.mean(hf_rates), statistics.mean(our_rates)
        batch1[group] = (h, o)
        rows.append([f"batch 1, {group} ({len(texts)} prompts)", h, o, o / h])
        print(rows[-1], flush=True)
    conc = {}
    pool = [render_chat(tok, t) for t in chat_prompts(16)]
    for c in [int(x) for x in args.concurrency.split(",")]:
        prompts = (pool * c)[:c]
        h = c * n / hf_generate(hf, tok, prompts, n)
        o = c * n / ours(llm, prompts, n)
        conc[c] = (h, o)
        rows.append([f"{c} concurrent, total", h, o, o / h])
        print(rows[-1], flush=True)
    table = markdown_table(["measurement (tokens/s)", "transformers", "specserve", "ratio"], rows)
    if 1 in conc and 16 in conc:
        table += f"\n\nspecserve at 16 concurrent / batch 1: {conc[16][1] / conc[1][1]:.2f}x"
    write_report("plain", "Plain decoding, SmolLM2-135M-Instruct fp32", table, "python -m bench.plain")
    plot(batch1, conc)


def plot(batch1: dict, conc: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    labels = list(batch1)
    x = range(len(labels))
    a.bar([i - 0.2 for i in x], [batch1[k][0] for k in labels], 0.4, label="transformers")
    a.bar([i + 0.2 for i in x], [batch1[k][1] for k in labels], 0.4, label="specserve")
    a.set_xticks(list(x), labels)
    a.set_ylabel("tokens/s")
    a.set_title("batch 1")
    a.legend()
    cs = sorted(conc)
    b.plot(cs, [conc[c][0] for c in cs], "o-", label="transformers")
    b.plot(cs, [conc[c][1] for c in cs], "o-", label="specserve")
    b.set_xlabel("concurrent requests")
    b.set_ylabel("total tokens/s")
    b.set_xscale("log", base=2)
    b.set_title("throughput")
    b.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "plain.png", dpi=100)


if __name__ == "__main__":
    main()
