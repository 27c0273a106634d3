"""With speculation on, greedy output equals the same engine's greedy output
with speculation off, on the default model (served quantized: the GGUF file's Q4_1
blocks; the draft model quantized to int8 at load), for Spec-Bench prompts of
different categories; seeded sampling is reproducible; no block is lost."""

import dataclasses
import json
from pathlib import Path

import pytest
from safetensors.torch import save_file

from bench.common import spec_bench
from engine import SamplingParams
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from tests.conftest import DEFAULT_MAX_MODEL_LEN, check_no_lost_blocks

# The first question of ten Spec-Bench categories (bench/data/), long articles cut to
# 1,200 characters so the test stays fast (copying still pays).
CATEGORIES = ["summarization", "rag", "translation", "qa", "math_reasoning", "writing", "coding", "extraction",
              "reasoning", "roleplay"]
NEW_TOKENS = 40


def spec_bench_prompts() -> list[str]:
    return [spec_bench(c, 1)[0][:1200] for c in CATEGORIES]


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def make(default_engine, spec: SpeculativeConfig) -> LLMEngine:
    config = EngineConfig(
        ModelConfig(max_model_len=DEFAULT_MAX_MODEL_LEN, dtype="float32", device="cpu"),
        CacheConfig(num_blocks=512),
        SchedulerConfig(max_num_batched_tokens=1024),
        spec,
    )
    return LLMEngine(config, model=default_engine.model, tokenizer=default_engine.tokenizer)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    reqs = [engine.add_request(f"q{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    check_no_lost_blocks(engine)
    if engine.speculator.drafter is not None and hasattr(engine.speculator.drafter, "kv"):
        assert engine.speculator.drafter.kv.num_free_blocks == engine.speculator.drafter.kv.pool.num_blocks
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def prompts(default_engine):
    return [chat_ids(default_engine.tokenizer, t) for t in spec_bench_prompts()]


@pytest.fixture(scope="module")
def plain_greedy(default_engine, prompts):
    return run(make(default_engine, SpeculativeConfig()), prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))


@pytest.fixture(scope="module")
def small_draft_model(default_engine, tmp_path_factory) -> Path:
    """A separate, smaller checkpoint sharing the tokenizer: the default model's first 8 layers."""
    out = tmp_path_factory.mktemp("draft")
    from engine.worker.model_store import fetch_default_model
    from safetensors import safe_open

    src = fetch_default_model()  # the float32 conversion (the draft is quantized at load: SPECS)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = 8
    (out / "config.json").write_text(json.dumps(config))
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        keep = {n: f.get_tensor(n) for n in f.keys() if not n.startswith("model.layers.") or int(n.split(".")[2]) < 8}
    save_file(keep, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            (out / name).write_bytes((src / name).read_bytes())
    return out


# Model drafters rarely pay on this model, so the adaptive policy would stop them drafting;
# exactness is what is tested here, so they draft every step.
SPECS = {
    "ngram": lambda _: SpeculativeConfig(method="ngram", num_speculative_tokens=6, verify_cost=0.05),
    "early_exit": lambda _: SpeculativeConfig(
        method="early_exit", num_speculative_tokens=3, num_layers=10, adaptive=False
    ),
    "draft_model": lambda path: SpeculativeConfig(
        method="draft_model", num_speculative_tokens=3, model=str(path), adaptive=False, quantization="int8"
    ),
    # Token trees: up to 3 children per node (adaptive: the policy picks the shape), and a static tree.
    "ngram-tree": lambda _: SpeculativeConfig(
        method="ngram", num_speculative_tokens=6, verify_cost=0.05, tree_width=3, max_tree_nodes=12
    ),
    "early_exit-tree": lambda _: SpeculativeConfig(
        method="early_exit", num_speculative_tokens=3, num_layers=10, adaptive=False, tree_width=2, max_tree_nodes=8
    ),
    "draft_model-tree": lambda path: SpeculativeConfig(
        method="draft_model", model=str(path), adaptive=False,
        speculative_token_tree=[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)],
    ),
}


# Model drafters grow trees one forward per depth: minutes on this CPU, so marked slow.
SLOW = {"early_exit-tree", "draft_model-tree"}


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in SPECS])
def test_greedy_output_is_unchanged_by_speculation(method, default_engine, prompts, plain_greedy, small_draft_model):
    engine = make(default_engine, SPECS[method](small_draft_model))
    drafted = []
    engine.stat_loggers.append(lambda s: drafted.append(s.spec.num_draft_tokens))
    outputs = run(engine, prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    assert sum(drafted) > 0
    for i, (got, want) in enumerate(zip(outputs, plain_greedy)):
        assert got == want, f"prompt {i} ({CATEGORIES[i]}) differs"


@pytest.mark.parametrize("method", ["ngram", pytest.param("early_exit", marks=pytest.mark.slow)])
def test_seeded_sampling_with_speculation_is_reproducible(method, default_engine, prompts, small_draft_model):
    """Reproducible from one engine to the next once the policy's cost is pinned
    (a measured cost may differ between starts, and so may the draft lengths)."""
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=1234)
    spec = dataclasses.replace(SPECS[method](small_draft_model), verify_cost=0.05)
    first = run(make(default_engine, spec), prompts[:3], params)
    again = run(make(default_engine, spec), prompts[:3], params)
    assert first == again
    alone = run(make(default_engine, spec), prompts[1:2], params)
    assert alone == first[1:2]  # whatever the batch
