"""One lifecycle per request: every end (finished, aborted, failed, preempted then
aborted) goes through the one release path, which frees everything the request
holds: KV blocks, the runner's generator, the drafter's and the policy's state."""

from engine.config import SpeculativeConfig
from tests.faults import fail_for
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import engine_config

PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # repeats: prompt lookup finds matches
SEEDED = SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True)  # the runner keeps a generator


def spec_engine(tiny_model, num_blocks: int = 64) -> LLMEngine:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, verify_cost=0.05, adaptive=False)
    config = engine_config(64, num_blocks=num_blocks, block_size=4, enable_prefix_caching=False, speculative=spec)
    return LLMEngine(config, model=tiny_model(vocab_size=16), tokenizer=None)


def held(engine: LLMEngine, rid: str) -> set[str]:
    """Where the engine still holds state for ``rid``."""
    places = {
        "scheduler": rid in engine.scheduler.requests,
        "kv blocks": bool(engine.kv_manager.block_table(rid)),
        "runner state": rid in engine.runner.requests,
        "runner generator": rid in engine.runner.generators,
        "drafter index": rid in engine.speculator.drafter.indexes,
        "policy record": rid in engine.speculator.policy.states,
    }
    return {name for name, is_held in places.items() if is_held}


def all_freed(engine: LLMEngine) -> bool:
    return engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks and not engine.scheduler.requests


def run_until(engine: LLMEngine, done) -> list:
    outs = []
    for _ in range(200):
        outs += engine.step()
        if done():
            return outs
    raise AssertionError("never happened")


def test_a_running_request_holds_everything_that_each_end_frees(tiny_model):
    engine = spec_engine(tiny_model)
    engine.add_request("a", PROMPT, SEEDED)
    run_until(engine, lambda: engine.speculator.policy.states.get("a") and engine.speculator.policy.states["a"].num_drafts)
    assert held(engine, "a") == {
        "scheduler", "kv blocks", "runner state", "runner generator", "drafter index", "policy record"
    }
    engine.abort_request("a")
    assert held(engine, "a") == set() and all_freed(engine)


def test_a_finished_request_frees_everything(tiny_model):
    engine = spec_engine(tiny_model)
    engine.add_request("f", PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True))
    outs = run_until(engine, lambda: not engine.has_unfinished())
    assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].spec["num_drafts"] > 0
    assert held(engine, "f") == set() and all_freed(engine)


def test_a_failed_request_frees_everything_and_the_others_run_on(tiny_model):
    engine = spec_engine(tiny_model)
    engine.add_request("ok", PROMPT, SEEDED)
    engine.add_request("bad", PROMPT[::-1], SEEDED)
    run_until(engine, lambda: "bad" in engine.runner.generators)
    engine.set_fault_hook(fail_for("sampler", {"bad"}))
    outs = run_until(engine, lambda: not engine.has_request("bad"))
    assert [o.finish_reason for o in outs if o.request_id == "bad"][-1] == "error"
    assert held(engine, "bad") == set() and engine.has_request("ok")
    run_until(engine, lambda: not engine.has_unfinished())
    assert held(engine, "ok") == set() and all_freed(engine)


def test_a_preempted_then_aborted_request_frees_everything(tiny_model):
    """16 blocks of 4 tokens: two requests that grow to 50 tokens each cannot both fit."""
    engine = spec_engine(tiny_model, num_blocks=16)
    engine.add_request("old", PROMPT, SEEDED)
    engine.add_request("new", PROMPT[1:], SEEDED)
    waiting = lambda: any(r.request_id == "new" and r.num_preemptions for r in engine.scheduler.waiting)  # noqa: E731
    run_until(engine, waiting)
    assert {"runner state", "runner generator"} <= held(engine, "new") and "kv blocks" not in held(engine, "new")
    engine.abort_request("new")
    assert held(engine, "new") == set()
    engine.abort_request("old")
    assert all_freed(engine) and not engine.runner.requests and not engine.runner.generators
    assert not engine.speculator.policy.states
