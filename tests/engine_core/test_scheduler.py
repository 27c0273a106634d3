"""The scheduler alone: the real Scheduler and KVCacheManager with a tiny KV
spec, plain Requests, and a fake runner that returns chosen tokens. No model."""

import dataclasses
import pickle
import random

import pytest

from engine.core.request import RequestStatus
from engine.core.scheduler import RunnerOutput
from tests.engine_core.scheduler_helpers import (
    EOS,
    assert_all_free,
    counts,
    create_request,
    create_scheduler,
    step,
)


def test_prefill_then_decode_counts_and_block_tables():
    sched = create_scheduler(block_size=4)
    a, b = create_request("a", 5), create_request("b", 3)
    sched.add(a), sched.add(b)
    out = step(sched)
    assert counts(out) == {"a": (0, 5, True), "b": (0, 3, True)}
    s_a = out.scheduled[0]
    assert s_a.token_ids == tuple(a.prompt_token_ids) and (s_a.block_start, len(s_a.new_block_ids)) == (0, 2)
    assert [n.request_id for n in out.new_requests] == ["a", "b"]  # sent whole once
    assert a.num_computed_tokens == 5 and a.num_tokens == 6 and a.status is RequestStatus.RUNNING
    out = step(sched)
    assert counts(out) == {"a": (5, 1, True), "b": (3, 1, True)}
    assert out.scheduled[0].token_ids == (a.token_ids[5],)  # the token sampled last step
    assert out.new_requests == () and out.scheduled[1].new_block_ids == ()  # b: 4 tokens fit in one block of 4
    out = step(sched)
    b_block = sched.kv.block_table("b")[1]
    # b's 5th token opens its second block
    assert (out.scheduled[1].block_start, out.scheduled[1].new_block_ids) == (1, (b_block,))
    for r in (a, b):
        sched.finish(r, "abort")
    assert_all_free(sched)


def test_chunked_prefill_within_the_token_budget():
    sched = create_scheduler(max_num_batched_tokens=4)
    long, short = create_request("long", 10), create_request("short", 3)
    sched.add(long), sched.add(short)
    steps = [counts(step(sched)) for _ in range(4)]
    assert steps == [
        {"long": (0, 4, False)},  # the budget is spent on the oldest request
        {"long": (4, 4, False)},
        {"long": (8, 2, True), "short": (0, 2, False)},  # the rest of the budget starts the next
        {"long": (10, 1, True), "short": (2, 1, True)},
    ]
    assert long.num_output_tokens == 2 and short.num_output_tokens == 1
    for r in (long, short):
        sched.finish(r, "abort")
    assert_all_free(sched)


def test_max_num_seqs_limits_running_requests():
    sched = create_scheduler(max_num_seqs=2)
    reqs = [create_request(f"r{i}", 3, max_tokens=2) for i in range(3)]
    for r in reqs:
        sched.add(r)
    assert set(counts(step(sched))) == {"r0", "r1"}
    assert reqs[2].status is RequestStatus.WAITING
    step(sched)  # r0, r1 reach max_tokens and finish
    assert reqs[0].finish_reason == reqs[1].finish_reason == "length"
    assert counts(step(sched)) == {"r2": (0, 3, True)}
    step(sched)
    assert reqs[2].is_finished
    assert_all_free(sched)


def test_eos_stop_token_and_max_model_len_finish_and_free():
    sched = create_scheduler(max_model_len=8)
    by_eos = create_request("eos", 2, max_tokens=10)
    by_id = create_request("id", 2, max_tokens=10, stop_token_ids=(7,))
    by_len = create_request("len", 6, max_tokens=10)
    ignore = create_request("ignore", 2, max_tokens=2, ignore_eos=True)
    for r in (by_eos, by_id, by_len, ignore):
        sched.add(r)
    out = sched.schedule()
    touched = sched.update(out, RunnerOutput({"eos": [EOS], "id": [7], "len": [1], "ignore": [EOS]}))
    assert {r.request_id for r in touched} == {"eos", "id", "len", "ignore"}
    assert by_eos.finish_reason == "stop" and by_eos.output_token_ids == [EOS]
    assert by_id.finish_reason == "stop" and by_id.output_token_ids == [7]
    assert not by_len.is_finished and not ignore.is_finished  # EOS ignored
    assert set(sched.take_finished_ids()) == {"eos", "id"}  # handed to the release path once
    assert sched.take_finished_ids() == []
    out = sched.schedule()
    assert set(counts(out)) == {"len", "ignore"}
    sched.update(out, RunnerOutput({"len": [1], "ignore": [1]}))
    assert by_len.finish_reason == "length" and by_len.num_tokens == 8  # max_model_len
    assert ignore.finish_reason == "length" and ignore.num_output_tokens == 2
    assert_all_free(sched)


def test_abort_of_running_and_waiting_requests_frees_blocks():
    sched = create_scheduler(num_blocks=8, max_num_seqs=1)
    running, waiting = create_request("run", 5), create_request("wait", 3)
    sched.add(running), sched.add(waiting)
    out = sched.schedule()
    assert sched.kv.num_free_blocks == 5
    # Aborted during the step: its sampled token is dropped.
    sched.finish(running, "abort")
    assert sched.update(out, RunnerOutput({"run": [1]})) == []
    assert running.output_token_ids == [] and running.finish_reason == "abort"
    sched.finish(waiting, "abort")
    sched.finish(waiting, "abort")  # twice: a no-op
    assert sched.take_finished_ids() == ["run", "wait"]
    assert_all_free(sched)


def test_preemption_hand_simulated():
    """Four blocks of two tokens. A and B (prompts of 2) grow one token per step;
    at step 4 A needs a third block, none is free, and the newest running
    request, B, is preempted: its blocks are freed and it is recomputed, prompt
    and output so far but its last token, once blocks are free again; the last
    token then decodes as it would have without the preemption (with its drafts)."""
    sched = create_scheduler(num_blocks=4, block_size=2)
    a, b = create_request("A", 2, max_tokens=4), create_request("B", 2, max_tokens=6)
    sched.add(a), sched.add(b)
    for _ in range(3):
        out = step(sched)
        assert set(counts(out)) == {"A", "B"} and not out.preempted_ids
    assert sched.kv.num_free_blocks == 0 and a.num_tokens == b.num_tokens == 5
    b_tokens = list(b.token_ids)
    out = step(sched)
    assert out.preempted_ids == ("B",) and counts(out) == {"A": (4, 1, True)}
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.token_ids == b_tokens and sched.num_preemptions == 1
    assert a.is_finished  # 4 tokens: its blocks are free again
    out = step(sched)
    assert counts(out) == {"B": (0, 4, False)}  # recomputed in one go, up to its last token
    assert out.scheduled[0].token_ids == tuple(b_tokens[:-1])
    out = step(sched)
    assert counts(out) == {"B": (4, 1, True)} and out.scheduled[0].token_ids == (b_tokens[-1],)
    while sched.requests:
        step(sched)
    assert b.num_output_tokens == 6
    assert_all_free(sched)


def test_self_preemption_when_the_newest_request_needs_a_block():
    sched = create_scheduler(num_blocks=5, block_size=2)
    a, b = create_request("A", 3, max_tokens=3), create_request("B", 3, max_tokens=3)
    sched.add(a), sched.add(b)
    step(sched), step(sched)
    out = step(sched)  # both need a third block; one is free: A takes it, B preempts itself
    assert out.preempted_ids == ("B",) and set(counts(out)) == {"A"}
    while sched.requests:
        step(sched)
    assert a.num_output_tokens == b.num_output_tokens == 3
    assert_all_free(sched)


@pytest.mark.parametrize("seed", range(3))
def test_random_workload_under_pressure_matches_unpressured(seed):
    """Requests arriving over time, a small pool, a small budget: preemptions
    and chunked prefills happen, every request still gets exactly the tokens
    of an unconstrained run, and no block is lost."""
    rng = random.Random(seed)
    specs = [(f"r{i}", rng.randint(1, 20), rng.randint(1, 12), rng.randint(0, 10)) for i in range(12)]

    def simulate(num_blocks, budget):
        sched = create_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, max_model_len=40)
        reqs, t = {}, 0
        while sched.requests or len(reqs) < len(specs):
            for rid, prompt_len, max_tokens, arrival in specs:
                if arrival == t:
                    reqs[rid] = create_request(rid, prompt_len, max_tokens)
                    sched.add(reqs[rid])
            out = step(sched)
            used = sum(len(sched.kv.block_table(r.request_id)) for r in sched.running)
            assert used + sched.kv.num_free_blocks == num_blocks  # every block held or free
            assert out.num_tokens <= budget
            t += 1
            assert t < 2000, "no progress"
        assert_all_free(sched)
        return {rid: r.output_token_ids for rid, r in reqs.items()}, sched.num_preemptions

    reference, none = simulate(num_blocks=200, budget=1000)
    assert none == 0
    pressured, preemptions = simulate(num_blocks=10, budget=8)
    assert preemptions > 0
    assert pressured == reference
    assert all(len(reference[rid]) == max_tokens for rid, _, max_tokens, _ in specs)


def test_the_output_is_plain_data_and_pickles():
    """No live Request crosses to the runner: every leaf of the output is a number, a string,
    a bool or None, and the output survives pickling (it could cross a process)."""
    sched = create_scheduler(block_size=4)
    sched.add(create_request("a", 5, temperature=0.7, logit_bias={3: 1.0})), sched.add(create_request("b", 3))
    for _ in range(3):
        out = step(sched)
        assert pickle.loads(pickle.dumps(out)) == out
        assert {type(x) for x in leaves(out)} <= {int, float, str, bool, type(None)}


def leaves(x):
    if dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            yield from leaves(getattr(x, f.name))
    elif isinstance(x, (tuple, list, frozenset, set)):
        for y in x:
            yield from leaves(y)
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(k)
            yield from leaves(v)
    else:
        yield x
