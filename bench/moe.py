"""Mixture-of-experts decoding speed against a dense model of the same active parameters.

    .venv/bin/python -m bench.moe [--rounds 3] [--new-tokens 64] [--concurrency 1,16]

Two random-weight checkpoints of real proportions, built with transformers' classes into
``--cache`` on first use: a Mixtral (8 experts, top 2, expert MLPs of ``--expert-size``)
and a Llama with the same attention whose one MLP is twice as wide, so that both compute
the same ~100M parameters per token (every expert weight is read at 16 concurrent
requests, only two at batch 1). Each round decodes greedily on both, back to back in this
one process (rotated order), at each concurrency; reports the median tokens/s and the
MoE/dense ratio. Writes bench/results/moe.md.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.common import markdown_table, rotated, write_report
from engine import LLM, SamplingParams

VOCAB = 32000


def shapes(args) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=12,
                num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)


def build(path: Path, kind: str, args) -> Path:
    """The checkpoint at ``path`` (saved once): "moe" or "dense", random weights, float32."""
    if (path / "config.json").exists():
        return path
    import shutil

    import transformers

    from engine.worker.model_store import fetch_default_model

    if kind == "moe":
        config = transformers.MixtralConfig(**shapes(args), intermediate_size=args.expert_size, num_local_experts=8,
                                            num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**shapes(args), intermediate_size=2 * args.expert_size)
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the default model's: ids < VOCAB only reach it
        shutil.copy(fetch_default_model() / name, path / name)
    return path


def active_params(llm: LLM) -> tuple[int, int]:
    """(parameters a token computes with, all parameters) of the engine's model."""
    model = llm.engine.model
    total = sum(p.numel() for p in model.parameters())
    arch = model.arch
    if arch.moe is None:
        return total, total
    expert = sum(p.numel() for p in model.layers[0].mlp.experts[0].parameters())
    return total - arch.num_layers * (arch.moe.num_experts - arch.moe.top_k) * expert, total


def decode_rate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    """Generated tokens per second, decoding ``prompts`` together (prefill excluded)."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, params)
    prefill = time.perf_counter() - t
    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, params)
    return len(prompts) * new_tokens / (time.perf_counter() - t - prefill)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--expert-size", type=int, default=1024, help="intermediate size of one expert")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "specserve" / "bench-moe")
    args = ap.parse_args()
    tag = f"h{args.hidden}-l{args.layers}-e{args.expert_size}"
    llms = {kind: LLM(str(build(args.cache / f"{kind}-{tag}", kind, args)), max_model_len=1024, num_blocks=512,
                      max_num_seqs=64) for kind in ("moe", "dense")}
    g = torch.Generator().manual_seed(0)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = {c: [torch.randint(3, VOCAB, (32,), generator=g).tolist() for _ in range(c)] for c in levels}
    for llm in llms.values():
        decode_rate(llm, prompts[levels[0]], 4)  # warm-up
    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for c in levels:
            for kind in rotated(list(llms), r):
                rates.setdefault((kind, c), []).append(decode_rate(llms[kind], prompts[c], args.new_tokens))
    rows = []
    for c in levels:
        moe, dense = (statistics.median(rates[kind, c]) for kind in ("moe", "dense"))
        rows.append([c, moe, dense, moe / dense])
    (moe_active, moe_total), (dense_active, _) = active_params(llms["moe"]), active_params(llms["dense"])
    body = (
        f"Mixtral-shaped MoE (8 experts, top 2; {moe_active / 1e6:.0f}M active of {moe_total / 1e6:.0f}M parameters) "
        f"against a Llama of the same attention and a twice-as-wide MLP ({dense_active / 1e6:.0f}M): hidden "
        f"{args.hidden}, {args.layers} layers, 12 heads over 4 KV heads, expert MLPs of {args.expert_size}; random "
        f"weights, float32, greedy, {args.new_tokens} new tokens after 32-token prompts, decode only, median of "
        f"{args.rounds} rounds run back to back in one process.\n\n"
        + markdown_table(["concurrent requests", "MoE tok/s", "dense tok/s", "MoE / dense"], rows)
    )
    print(body)
    write_report("moe", "Mixture-of-experts decoding against dense, same active parameters", body,
                 f"--rounds {args.rounds} --new-tokens {args.new_tokens} --concurrency {args.concurrency} "
                 f"--hidden {args.hidden} --layers {args.layers} --expert-size {args.expert_size}")


if __name__ == "__main__":
    main()
