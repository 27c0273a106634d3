"""AsyncEngine: the engine loop on its own thread, streams for asyncio.

On the default model, so that a request of many tokens takes long enough for
an abort to reach it mid-generation."""

import asyncio
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.sampling_params import InvalidParameter
from tests.engine_core.engine_helpers import greedy, run


@pytest.fixture
def async_engine(make_engine):
    engine = AsyncEngine(make_engine(num_blocks=32, max_model_len=512))
    yield engine
    engine.shutdown()
    assert not engine._thread.is_alive()


def wait_idle(async_engine: AsyncEngine, timeout: float = 30.0) -> None:
    """Until the engine thread has no request left (an abort crosses a queue)."""
    deadline = time.monotonic() + timeout
    while async_engine.engine.has_unfinished():
        assert time.monotonic() < deadline, "the engine did not drop the request"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def prompt(default_tokenizer):
    return default_tokenizer.encode("The three primary colors are", add_special_tokens=False)


def test_stream_gives_the_synchronous_output(async_engine, default_engine, prompt):
    (expected,) = run(default_engine, [prompt], greedy(8))

    async def main():
        stream = await async_engine.add_request("s", prompt, greedy(8))
        return [out async for out in stream]

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])
    assert [t for o in outs for t in o.new_token_ids] == expected.token_ids
    assert "".join(o.new_text for o in outs) == expected.text
    wait_idle(async_engine)
    assert async_engine.engine.kv_manager.num_free_blocks == 32


def test_abort_ends_the_stream_and_frees_blocks(async_engine, prompt):
    async def main():
        stream = await async_engine.add_request("a", prompt, greedy(500))
        outs = []
        async for out in stream:
            outs.append(out)
            if len(outs) == 2:
                async_engine.abort("a")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert outs[-1].num_output_tokens < 500
    wait_idle(async_engine)
    assert async_engine.engine.kv_manager.num_free_blocks == 32


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_closing_the_stream_early_aborts_and_frees_blocks(async_engine, prompt, how):
    async def main():
        stream = await async_engine.add_request("c", prompt, greedy(500))
        if how == "aclose":  # the consumer stops reading (client disconnect)
            first = await anext(stream)
            assert first.new_token_ids
            await stream.aclose()
        else:  # the consuming task is cancelled
            got_one = asyncio.Event()

            async def consume():
                async for _ in stream:
                    got_one.set()

            task = asyncio.create_task(consume())
            await got_one.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        deadline = time.monotonic() + 30  # the loop stays open until the abort is done
        while async_engine.engine.has_unfinished():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert async_engine.engine.kv_manager.num_free_blocks == 32
    assert async_engine.is_running


def test_invalid_and_duplicate_requests(async_engine, prompt):
    async def main():
        with pytest.raises(InvalidParameter):
            await async_engine.add_request("bad", [], greedy(4))
        first = await async_engine.add_request("dup", prompt, greedy(500))
        await anext(first)
        with pytest.raises(ValueError, match="already in use"):  # refused at the door
            await async_engine.add_request("dup", prompt, greedy(4))
        # The refused duplicate did not abort the request that owns the id.
        for _ in range(3):
            assert not (await anext(first)).finished
        await first.aclose()

    asyncio.run(main())
    wait_idle(async_engine)
    assert async_engine.engine.kv_manager.num_free_blocks == 32


def test_a_consumer_whose_event_loop_closed_is_aborted_and_the_engine_lives_on(async_engine, prompt):
    async def submit_and_leave():
        return await async_engine.add_request("gone", prompt, greedy(500))

    asyncio.run(submit_and_leave())  # the loop closes; the engine's deltas for it cannot be delivered
    wait_idle(async_engine)
    assert async_engine.is_running
    assert async_engine.engine.kv_manager.num_free_blocks == 32

    async def again():
        return [out async for out in await async_engine.add_request("next", prompt, greedy(3))]

    assert asyncio.run(again())[-1].finish_reason == "length"
