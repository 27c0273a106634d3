"""Fixtures of the reliability tests: engines of their own around the session's
default-model weights, live servers on loopback (``tests.server.conftest``),
and small HTTP helpers. Each test that used one of these engines ends with it
idle and its block pool back to its starting free count."""

import json
import threading

import httpx
import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from tests.server.conftest import MAX_MODEL_LEN, wait_idle

ENGINE_FIXTURES = ("rel_engine", "ngram_engine")


def make_engine(default: LLMEngine, *, num_blocks: int = 160, max_model_len: int = MAX_MODEL_LEN, spec=None, **sched):
    """An engine (KV cache, scheduler, drafter) of its own around the default model's weights."""
    config = EngineConfig(
        ModelConfig(max_model_len=max_model_len),
        CacheConfig(num_blocks=num_blocks),
        SchedulerConfig(**sched),
        speculative=spec or SpeculativeConfig(),
    )
    return LLMEngine(config, model=default.model, tokenizer=default.tokenizer)


def ngram_config(k: int = 4) -> SpeculativeConfig:
    # Pinned verify cost and no adaptation: the drafter is asked every step, the same way every run.
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, verify_cost=0.05, adaptive=False)


@pytest.fixture(scope="session")
def rel_engine(default_engine, session_engines) -> LLMEngine:
    engine = make_engine(default_engine)
    session_engines.append(engine)
    return engine


@pytest.fixture(scope="session")
def ngram_engine(default_engine, session_engines) -> LLMEngine:
    engine = make_engine(default_engine, spec=ngram_config())
    session_engines.append(engine)
    return engine


@pytest.fixture(autouse=True)
def reliability_engines_idle(request):
    yield
    for name in ENGINE_FIXTURES:
        if name in request.fixturenames:
            wait_idle(request.getfixturevalue(name))


def parse_sse(lines) -> list:
    """The payloads of an SSE body: parsed JSON objects, and the string "[DONE]"."""
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream(url: str, body: dict, path: str = "/v1/completions", headers: dict | None = None, timeout: float = 120):
    """POSTs ``body`` with stream=true; returns (status, events)."""
    with httpx.Client(base_url=url, timeout=timeout) as http:
        with http.stream("POST", path, json={**body, "stream": True}, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, r.json()
            return 200, parse_sse(r.iter_lines())


def stream_text(events: list) -> str:
    return "".join(c["text"] for e in events if isinstance(e, dict) and "choices" in e for c in e["choices"])


def finish_reason(events: list) -> str | None:
    reasons = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", ())]
    return next((r for r in reversed(reasons) if r), None)


def in_threads(fn, args_list: list) -> list:
    """``fn(*args)`` for each args, concurrently; the results in order (exceptions re-raised)."""
    results: list = [None] * len(args_list)

    def run(i, args):
        try:
            results[i] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, a), daemon=True) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
        assert not t.is_alive(), "a request thread hung"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def leftover_state(engine: LLMEngine, serving=None) -> dict[str, int]:
    """Per-request state still held anywhere once every request has ended (all counts
    must be 0): what a slow leak under load would be made of. Every end releases
    everything at once (``LLMEngine._release``), so nothing waits for a later step."""
    held = {
        "scheduler.requests": len(engine.scheduler.requests),
        "kv block tables": len(engine.kv_manager._tables),
        "runner.requests": len(engine.runner.requests),
        "runner.generators": len(engine.runner.generators),
    }
    if engine.speculator.policy is not None:
        held["policy.states"] = len(engine.speculator.policy.states)
    for name in ("indexes", "cached", "generators"):
        if isinstance(getattr(engine.speculator.drafter, name, None), dict):
            held[f"drafter.{name}"] = len(getattr(engine.speculator.drafter, name))
    if serving is not None:
        held.update({"serving.live": len(serving.live), "serving.pending": serving.pending})
        held["async streams"] = len(serving.engine._streams)
    return held
