"""Structured outputs: decoding speed under a JSON schema, with and without speculation.

    .venv/bin/python -m bench.structured [--prompts 6] [--max-tokens 160]

In-process engines on the default model (fp32, CPU, batch 1, greedy) share the
weights: plain decoding without a grammar (the cost of the mask, by comparison),
plain under the schema, and prompt lookup (ngram) and early exit under the
schema. Prompts ask to extract fields of a given text into JSON (copy-heavy, so
prompt lookup finds drafts). Greedy answers under the schema must be identical
with and without speculation (exactness). Columns: output tokens, end-to-end
tokens/s (prompt processing included), speedup over plain under the schema,
mean acceptance length (1 + accepted / drafting rounds), share of the answers
that validate. Writes bench/results/structured.md.
"""

import argparse
import json
import time

import jsonschema

from bench.common import markdown_table, render_chat, write_report
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import GuidedDecoding, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "email", "skills"],
    "additionalProperties": False,
}
PEOPLE = [
    ("Alice Johnson", 34, "Portland", "alice.johnson@example.com", ["Python", "data analysis"]),
    ("Marco Rossi", 51, "Milan", "marco.rossi@example.org", ["cooking", "wine tasting", "Italian"]),
    ("Priya Natarajan", 27, "Bangalore", "priya.n@example.in", ["machine learning", "statistics"]),
    ("Tom Becker", 45, "Hamburg", "tom.becker@example.de", ["carpentry", "sailing"]),
    ("Aiko Tanaka", 22, "Osaka", "aiko.tanaka@example.jp", ["illustration", "animation", "design"]),
    ("Samuel Okafor", 39, "Lagos", "samuel.okafor@example.ng", ["accounting", "football"]),
]
METHODS = {
    "plain, no schema": (None, False),
    "plain": (None, True),
    "ngram": ({"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4}, True),
    "early_exit": ({"method": "early_exit", "num_speculative_tokens": 3, "num_layers": 8}, True),
}


def prompt(person) -> str:
    name, age, city, email, skills = person
    return (
        f"Extract name, age, city, email and skills from this text as JSON.\n\n"
        f"{name} is {age} years old and lives in {city}. You can write to {email}. "
        f"{name.split()[0]}'s skills: {', '.join(skills)}."
    )


def engine_for(base: LLMEngine, spec: dict | None) -> LLMEngine:
    sc = SpeculativeConfig(**spec, adaptive=False, verify_cost=1.0) if spec else SpeculativeConfig()
    config = EngineConfig(ModelConfig(max_model_len=1024, dtype="float32"), CacheConfig(num_blocks=128), SchedulerConfig(), sc)
    return LLMEngine(config, model=base.model, tokenizer=base.tokenizer)


def run_one(engine: LLMEngine, ids: list[int], params: SamplingParams) -> tuple[str, int, dict, float]:
    t = time.perf_counter()
    req = engine.add_request(f"r{time.monotonic_ns()}", ids, params)
    spec = {}
    while engine.has_unfinished():
        for out in engine.step():
            spec = out.spec or spec
    return req.output_text, req.num_output_tokens, spec, time.perf_counter() - t


def run(args) -> dict:
    base = LLMEngine(EngineConfig(ModelConfig(max_model_len=1024, dtype="float32"), CacheConfig(num_blocks=128)))
    prompts = [render_chat(base.tokenizer, prompt(p)) for p in PEOPLE[: args.prompts]]
    guided = GuidedDecoding("json", json.dumps(SCHEMA))
    engines, params = {}, {}
    for name, (spec, constrained) in METHODS.items():
        engines[name] = engine_for(base, spec)
        params[name] = SamplingParams(max_tokens=args.max_tokens, temperature=0, guided=guided if constrained else None)
        run_one(engines[name], prompts[0], params[name])  # warm-up
    results = {name: [] for name in METHODS}
    for i, ids in enumerate(prompts):  # prompt by prompt, every method in turn: ratios side by side
        for name in METHODS:
            results[name].append(run_one(engines[name], ids, params[name]))
        print(f"prompt {i}:", " ".join(f"{n} {r[-1][1] / r[-1][3]:.1f} tok/s" for n, r in results.items()), flush=True)
    return results


def report(results: dict, args) -> None:
    base = results["plain"]
    rows = []
    for name, runs in results.items():
        tokens, seconds = sum(r[1] for r in runs), sum(r[3] for r in runs)
        drafts = sum(r[2].get("num_drafts", 0) for r in runs)
        accepted = sum(r[2].get("num_accepted_tokens", 0) for r in runs)
        valid = sum(_valid(r[0]) for r in runs) / len(runs)
        same = "-" if name.endswith("no schema") else "yes" if [r[0] for r in runs] == [r[0] for r in base] else "no"
        speedup = (tokens / seconds) / (sum(r[1] for r in base) / sum(r[3] for r in base))
        rows.append([name, tokens, tokens / seconds, speedup, 1 + accepted / drafts if drafts else "-", valid, same])
    table = markdown_table(
        ["method", "tokens", "tok/s (e2e)", "speedup vs plain under the schema", "mean acc. length", "valid",
         "same text as plain"],
        rows,
    )
    body = (
        f"{len(base)} extraction prompts, one JSON schema (5 fields), greedy, batch 1, max_tokens {args.max_tokens}.\n\n"
        + table
        + "\n\nExample answer under the schema: `" + base[0][0] + "`\n"
    )
    path = write_report("structured", "Structured outputs with and without speculation", body,
                        f"python -m bench.structured --prompts {args.prompts} --max-tokens {args.max_tokens}")
    print(path.read_text())


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    report(run(args), args)


if __name__ == "__main__":
    main()
