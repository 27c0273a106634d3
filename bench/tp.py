"""Tensor parallelism on this machine: tp=1 against tp=2, offline engine, greedy.

    .venv/bin/python -m bench.tp [--new-tokens 64]

Batch 1 and batch 16 (the same chat prompts), tokens/s over the whole run
(prompt processing included), engine steps, and, at tp=2, the time rank 0
spends in collectives per step (``TPGroup.comm``: the all-reduces after the
row-parallel layers and the embedding, the vocabulary all-gather; it includes
waiting for the slower rank). On a 2-core CPU two ranks share the cores that one rank uses alone: no speed-up
is expected; the point is the overhead. Writes bench/results/tp.md.
"""

import argparse
import os
import time

from bench.common import chat_prompts, markdown_table, render_chat, write_report
from engine import LLM, SamplingParams


def measure(tp: int, batches: list[int], new_tokens: int) -> list[list]:
    llm = LLM(max_model_len=1024, tensor_parallel_size=tp)
    engine = llm.engine
    steps = []
    engine.stat_loggers.append(lambda stats: steps.append(1))
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate([render_chat(llm.tokenizer, "Hello")], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    rows = []
    try:
        for batch in batches:
            prompts = [render_chat(llm.tokenizer, p) for p in chat_prompts(batch)]
            comm = engine.tp_workers.group.comm if engine.tp_workers else None
            calls0, comm0 = (comm.calls, comm.seconds) if comm else (0, 0.0)
            steps.clear()
            t = time.perf_counter()
            llm.generate(prompts, params)
            seconds = time.perf_counter() - t
            tokens = batch * new_tokens
            comm_ms = (comm.seconds - comm0) * 1e3 / len(steps) if comm else 0.0
            calls = (comm.calls - calls0) / len(steps) if comm else 0
            step_ms = seconds * 1e3 / len(steps)
            rows.append([tp, batch, tokens / seconds, len(steps), step_ms, comm_ms, round(calls)])
            print(rows[-1], flush=True)
    finally:
        llm.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = measure(1, batches, args.new_tokens) + measure(2, batches, args.new_tokens)
    header = ["tp", "batch", "tokens/s", "steps", "ms/step", "collectives ms/step", "collectives/step"]
    body = (
        markdown_table(header, rows)
        + "\n\nSmolLM2-135M-Instruct, float32, CPU, gloo. Collectives: the time rank 0 waits in all-reduce and "
        "all-gather per step, transfer and wait for the other rank together (2 all-reduces per layer, 1 for "
        "the embedding, 1 all-gather of the logits). Threads per rank: the cores divided by tp. "
        f"Load average when it ended: {os.getloadavg()[0]:.1f} (other jobs on the machine make the figures "
        "indicative only).\n"
    )
    command = f"python -m bench.tp --new-tokens {args.new_tokens}"
    path = write_report("tp", "Tensor parallelism: tp=1 vs tp=2", body, command)
    print(path.read_text())


if __name__ == "__main__":
    main()
