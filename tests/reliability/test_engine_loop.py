"""The async engine loop under faults and races, on a tiny random-weight model:
a step that raises after some of its requests ended, a request that arrives as
the loop dies, and many concurrent aborts of one request. Every stream ends
(never hangs) and every KV block comes back."""

import asyncio
import threading

import pytest

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import check_no_lost_blocks

NUM_BLOCKS = 32


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(tiny_model):
    config = EngineConfig(
        ModelConfig(max_model_len=128, dtype="float32", device="cpu"), CacheConfig(num_blocks=NUM_BLOCKS)
    )
    llm = LLMEngine(config, model=tiny_model(), tokenizer=None)
    engine = AsyncEngine(llm)
    yield engine
    engine.shutdown()
    assert not engine._thread.is_alive()
    check_no_lost_blocks(llm)


async def collect(stream, timeout: float = 30.0) -> list:
    async def drain():
        return [out async for out in stream]

    return await asyncio.wait_for(drain(), timeout)


def test_a_step_that_raises_after_a_request_ended_still_ends_its_stream(engine):
    """The request of one token finishes inside the step, which then raises: its
    final delta was lost with the step, so its stream ends with an error (it used
    to wait forever); the engine keeps serving."""
    llm = engine.engine
    real, calls = llm._after_step, []

    def after_step_that_fails_once(*args):
        real(*args)
        if not calls:
            calls.append(1)
            raise RuntimeError("bookkeeping failed")

    llm._after_step = after_step_that_fails_once

    async def main():
        short = await engine.add_request("short", [1, 2, 3], greedy(1))
        outs = await collect(short)
        later = await engine.add_request("later", [4, 5, 6], greedy(4))
        return outs, await collect(later)

    outs, later = asyncio.run(main())
    assert calls and outs[-1].finished and outs[-1].finish_reason == "error"
    assert "RuntimeError" in outs[-1].error
    assert later[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in later) == 4


def test_a_request_that_arrives_as_the_loop_dies_is_refused_not_lost(engine, monkeypatch):
    """``add_request`` checked ``is_running`` just before the loop ended; the loop
    never reads its message, so ``add_request`` fails it itself."""
    engine.shutdown()
    assert engine._stopped.is_set()
    monkeypatch.setattr(AsyncEngine, "is_running", property(lambda self: True))  # the check passed before the end

    async def main():
        stream = await engine.add_request("late", [1, 2, 3], greedy(4))
        return await collect(stream, timeout=5)

    with pytest.raises(EngineDeadError):
        asyncio.run(main())


def test_concurrent_aborts_of_one_request(engine):
    """Eight threads and the event loop abort the same request forty times while it
    runs: its stream ends once, with finish_reason 'abort'; the engine serves on."""

    async def main():
        stream = await engine.add_request("victim", [7, 8, 9], greedy(100))
        first = await stream.__anext__()
        go = threading.Event()

        def hammer():
            go.wait()
            for _ in range(5):
                engine.abort("victim")

        threads = [threading.Thread(target=hammer) for _ in range(8)]
        for t in threads:
            t.start()
        go.set()
        for _ in range(5):
            engine.abort("victim")
            await asyncio.sleep(0)
        rest = await collect(stream)
        for t in threads:
            t.join(10)
        after = await collect(await engine.add_request("after", [7, 8, 9], greedy(3)))
        return [first, *rest], after

    outs, after = asyncio.run(main())
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finish_reason == "abort"
    assert after[-1].finish_reason == "length"
