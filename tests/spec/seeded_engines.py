"""The engines of the seeded-traffic tests (engine level here, HTTP in
tests/server/test_seeded_http.py): every drafter on one small target, measured costs
kept moving by the real steps, a small token budget and a shared, cached prompt."""

import torch

from drafters.draft_model import ModelDrafter
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.spec_decode.cost_tracker import CostTracker
from engine.spec_decode.policy import SpecPolicy, StepCosts
from tests.spec.eagle_heads import small_target, write_random_head

BLOCK = 4
BUDGET = 16  # tokens per step: prompts in chunks; 15 others decoding leave one token for the newest
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3]  # 6 full blocks and one token
DRAFTERS = ["ngram", "draft_model", "early_exit", "eagle", "eagle3", "ngram+eagle", "eagle3-tree"]


def soft_target(**kw):
    """``small_target`` with its head scaled down: distributions spread enough that random
    drafters' guesses are accepted now and then."""
    model = small_target(layers=4, **kw)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.2)
    return model


def build(name: str, tmp_path, tokenizer=None, num_blocks: int = 256) -> LLMEngine:
    target = soft_target()
    method, tree = name.removesuffix("-tree"), name.endswith("-tree")
    drafter = None
    kw = dict(tree_width=2, max_tree_nodes=6) if tree else {}
    if method == "draft_model":
        method, drafter = "test", ModelDrafter(soft_target(), 3, 256, BLOCK, torch.float32,
                                               torch.device("cpu"), 0.2)
    elif "eagle" in method:
        kind = "eagle3" if method.endswith("eagle3") else "eagle"
        kw["model"] = str(write_random_head(target, kind, tmp_path / kind, seed=2, std=0.3,
                                            draft_vocab=12 if kind == "eagle3" else None))
    elif method == "early_exit":
        kw["num_layers"] = 1
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, **kw)  # measured costs, adaptive
    config = EngineConfig(
        ModelConfig(max_model_len=128, dtype="float32", device="cpu"),
        CacheConfig(block_size=BLOCK, num_blocks=num_blocks, enable_prefix_caching=True),
        SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=BUDGET),
        spec,
    )
    engine = LLMEngine(config, model=target, tokenizer=tokenizer, drafter=drafter)
    # The table timed at start-up, replaced by one shaped as a GPU's (extra rows nearly free
    # up to a few) and drafts priced at 0.05 of a step: drafting then pays on this tiny model
    # whatever the machine's load. The tracker moves it with the real steps' times from here.
    timed = engine.speculator.policy.step_costs
    table = StepCosts(timed.rows, (1.0, 1.02, 1.04, 1.08, 1.3, 2.0, 2.8), one_token_s=timed.one_token_s)
    engine.speculator.policy = SpecPolicy(spec, 0.05, table)
    engine.speculator.cost_tracker = CostTracker(table)
    return engine
