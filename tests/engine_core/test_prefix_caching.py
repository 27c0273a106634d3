"""Prefix caching through the scheduler (fake runner) and the whole engine (tiny
random model): shared prefixes start computed, speculation never writes into a
shared block, and greedy outputs are the same with the cache on and off."""

import random

import pytest
import torch

from engine.config import SpeculativeConfig
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.core.scheduler import RunnerOutput
from tests.engine_core.engine_helpers import greedy, run
from tests.engine_core.scheduler_helpers import EOS, check_runner_tables, counts, create_scheduler, fake_token, step

VOCAB = 512


def request(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), frozenset({EOS}))


# -- the scheduler ------------------------------------------------------------


def test_a_second_request_with_the_same_prompt_computes_only_its_tail():
    sched = create_scheduler(num_blocks=32, block_size=4, enable_prefix_caching=True)
    prompt = [random.Random(0).randrange(50) for _ in range(18)]
    a = request("a", prompt)
    sched.add(a)
    first = step(sched)
    assert counts(first) == {"a": (0, 18, True)}
    assert (first.num_prefix_cache_queries, first.num_prefix_cache_hits) == (18, 0)
    b = request("b", prompt)
    sched.add(b)
    out = step(sched)
    # 4 full blocks (16 tokens) cached; the block of b's last token is computed.
    assert counts(out)["b"] == (16, 2, True)
    assert (out.num_prefix_cache_queries, out.num_prefix_cache_hits) == (18, 16)
    shared = sched.kv.block_table("a")[:4]
    assert sched.kv.block_table("b")[:4] == shared and sched.kv.block_table("b")[4] != sched.kv.block_table("a")[4]
    assert all(sched.kv.pool.ref_count(x) == 2 for x in shared)
    while sched.requests:
        step(sched)
    assert a.output_token_ids == b.output_token_ids  # same tokens, same fake model
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks


def test_cache_off_admits_from_zero_and_counts_nothing():
    sched = create_scheduler(num_blocks=32, block_size=4)
    prompt = list(range(18))
    for rid in ("a", "b"):
        sched.add(request(rid, prompt))
        out = step(sched)
        assert counts(out)[rid] == (0, 18, True)
        assert (out.num_prefix_cache_queries, out.num_prefix_cache_hits) == (0, 0)
    while sched.requests:
        step(sched)
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks


def spec_step(sched, rng: random.Random):
    """schedule -> fake drafts and verification (a random number accepted) -> update.
    Before the 'forward', checks that every slot written this step (the computed
    tokens and the draft slots) lies in a private, uncached block; after it, that no
    table shrank (rejected drafts keep their blocks). Returns the step's output and how
    many requests had drafts rejected."""
    out = sched.schedule({r.request_id: 3 for r in sched.running})  # the plan: 3 drafts for every decode
    check_runner_tables(sched, out, sched.__dict__.setdefault("runner_tables", {}))  # through rollbacks too
    pool, bs = sched.kv.pool, sched.kv.block_size
    tables = {s.request_id: list(sched.kv.block_table(s.request_id)) for s in out.scheduled}
    for s in out.scheduled:
        for pos in range(s.context_len, s.context_len + len(s.token_ids) + s.num_draft_tokens):
            block = tables[s.request_id][pos // bs]
            assert pool.ref_count(block) == 1 and not pool.is_cached(block), (s.request_id, pos)
    sampled, accepted, rejected = {}, {}, 0
    for s in out.scheduled:
        if not s.sample:
            continue
        k = s.num_draft_tokens
        j = rng.randint(0, k)
        tokens = [fake_token(sched.requests[s.request_id])] * (j + 1)  # accepted drafts + recovered / bonus token
        sampled[s.request_id] = tokens
        if k:
            accepted[s.request_id] = j
            rejected += j < k
    sched.update(out, RunnerOutput(sampled, num_draft_tokens={r: 3 for r in accepted}, num_accepted=accepted))
    for req in sched.running:  # registered blocks hold verified positions only
        table = sched.kv.block_table(req.request_id)
        cached = [i for i, b in enumerate(table) if pool.is_cached(b)]
        assert all((i + 1) * bs <= req.num_computed_tokens for i in cached)
    for s in out.scheduled:
        if s.request_id in sched.requests:
            assert len(sched.kv.block_table(s.request_id)) >= len(tables[s.request_id])
    return out, rejected


@pytest.mark.parametrize("seed", range(3))
def test_speculation_never_writes_into_a_shared_block(seed):
    """Shared blocks cover positions below num_computed_tokens, drafts are written at
    or above it: no copy-on-write is needed, and a rejected draft's slot stays private."""
    rng = random.Random(seed)
    sched = create_scheduler(
        num_blocks=64, block_size=4, max_model_len=128, enable_prefix_caching=True
    )
    common = [rng.randrange(50) for _ in range(13)]
    hits = rejections = 0
    for i in range(6):
        sched.add(request(f"r{i}", common + [rng.randrange(50) for _ in range(i)], max_tokens=30))
        out, _ = spec_step(sched, rng)
        hits += out.num_prefix_cache_hits
    while sched.requests:
        rejections += spec_step(sched, rng)[1]
    assert hits > 0 and rejections > 0
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks


def test_rejected_drafts_do_not_evict_cached_prefixes():
    """Rollback is "do not commit": a request whose drafts are all rejected keeps its
    reserved draft blocks instead of freeing and re-taking one every step, so the prefix
    cache keeps what fits beside it. Here a finished request's 3 cached blocks and a
    drafting request's 11 (positions 0 .. 42: its drafts never pass max_tokens) fit in 16."""
    sched = create_scheduler(num_blocks=16, block_size=4, max_model_len=64, enable_prefix_caching=True)
    prompt = list(range(10, 22))
    sched.add(request("a", prompt, max_tokens=1))  # 12 tokens computed: 3 full blocks cached
    while sched.requests:
        step(sched)
    assert sched.kv.pool.num_cached_blocks == 3
    b = request("b", [1, 2, 3, 4], max_tokens=40)
    sched.add(b)
    taken = 0
    while sched.requests:
        before = sched.kv.num_free_blocks
        out = sched.schedule({r.request_id: 3 for r in sched.running})  # 3 drafts, every one rejected
        taken += max(0, before - sched.kv.num_free_blocks)
        sampled = {s.request_id: [fake_token(sched.requests[s.request_id])] for s in out.scheduled if s.sample}
        drafted = {s.request_id: s.num_draft_tokens for s in out.scheduled if s.num_draft_tokens}
        sched.update(out, RunnerOutput(sampled, num_draft_tokens=drafted, num_accepted={r: 0 for r in drafted}))
    assert b.num_output_tokens == 40 and taken == 11  # each block taken once
    assert len(sched.kv.find_cached_prefix("a-again", prompt + [0])) == 3  # the prefix is still cached


def test_eviction_under_pressure_then_a_lookup_misses():
    sched = create_scheduler(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = request("a", list(range(10, 22)), max_tokens=1)  # 12 tokens, all computed: 3 full blocks cached
    sched.add(a)
    while sched.requests:
        step(sched)
    assert sched.kv.pool.num_cached_blocks == 3 and sched.kv.num_free_blocks == 8
    other = request("other", list(range(30, 58)), max_tokens=1)  # 28 tokens: 7 of 8 blocks
    sched.add(other)
    while sched.requests:
        step(sched)
    again = request("again", list(range(10, 22)), max_tokens=1)
    sched.add(again)
    out = step(sched)
    # 'other' took the never-used blocks, then a's blocks, tail first: a's first block survived.
    assert counts(out)["again"] == (4, 8, True)
    while sched.requests:
        step(sched)
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks


# -- the engine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(vocab_size=VOCAB, seed=0)


def shared_prompts(seed: int = 0) -> list[list[int]]:
    """A 45-token prefix (a repeated motif, so n-gram lookup drafts) and tails of 0 to 20 tokens."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, VOCAB, (15,), generator=g).tolist()
    prefix = motif * 3
    return [prefix + torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in (3, 0, 20, 7, 16)]


def hit_counter(engine) -> list[tuple[int, int]]:
    seen = []
    engine.stat_loggers.append(lambda s: seen.append((s.num_prefix_cache_queries, s.num_prefix_cache_hits)))
    return seen


def run_in_turns(engine, prompts, params) -> list[list[int]]:
    """The first prompt alone, then the rest together (so they can hit its blocks)."""
    first = run(engine, prompts[:1], params, prefix="first")
    rest = run(engine, prompts[1:], params)
    return [o.token_ids for o in first + rest]


NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, verify_cost=0.05, adaptive=False)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"speculative": NGRAM},
        {"num_blocks": 12, "max_model_len": 128, "max_num_batched_tokens": 24},  # preemption, chunks, eviction
        {"num_blocks": 12, "max_model_len": 128, "max_num_batched_tokens": 24, "speculative": NGRAM},
    ],
    ids=["plain", "ngram", "pressure", "pressure-ngram"],
)
def test_greedy_outputs_are_the_same_with_the_cache_on_and_off(make_engine, model, kw):
    prompts, params = shared_prompts(), greedy(24)
    off = run_in_turns(make_engine(model, enable_prefix_caching=False, **kw), prompts, params)
    on_engine = make_engine(model, **kw)
    hits = hit_counter(on_engine)
    drafted = []
    if on_engine.speculator.policy is not None:
        on_engine.stat_loggers.append(lambda s: drafted.append(s.spec.num_draft_tokens))
    assert run_in_turns(on_engine, prompts, params) == off
    assert sum(h for _, h in hits) > 0
    assert on_engine.speculator.policy is None or sum(drafted) > 0
    assert "num_blocks" not in kw or on_engine.scheduler.num_preemptions > 0
    assert on_engine.kv_manager.pool.num_cached_blocks > 0  # and still all free: checked by make_engine


def test_the_second_turn_of_a_conversation_hits_the_cache(make_engine, model):
    prompt = shared_prompts(seed=1)[2]  # 65 tokens
    engine = make_engine(model)
    (turn1,) = run(engine, [prompt], greedy(20), prefix="turn1")
    follow_up = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    turn2_prompt = prompt + turn1.token_ids + follow_up
    hits = hit_counter(engine)
    (turn2,) = run(engine, [turn2_prompt], greedy(10), prefix="turn2")
    # Turn 1 computed all its tokens but the last (84 of 85): 5 full blocks of 16.
    assert hits[0] == (len(turn2_prompt), 80)
    (cold,) = run(make_engine(model, enable_prefix_caching=False), [turn2_prompt], greedy(10))
    assert turn2.token_ids == cold.token_ids


@pytest.mark.parametrize("kernels", ["c", "torch"])
def test_a_hit_on_a_bfloat16_cache_gives_the_numbers_of_recomputation(make_engine, tiny_model, kernels, monkeypatch):
    """A hit reads the bfloat16 keys and values the first request wrote; recomputing writes the
    same rounded ones and reads them back (new keys too are read as the cache holds them): the
    same logprobs, bit for bit on the C kernels (docs/cpu.md), within 1e-4 on torch's ops."""
    from engine.layers import cpu_kernels

    if kernels == "torch":
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    elif cpu_kernels.load() is None:
        pytest.skip("no C kernels on this machine")
    model = tiny_model(vocab_size=VOCAB, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    model.prepack()
    prompts = shared_prompts(seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)

    def numbers(engine) -> list:
        outs = run(engine, prompts[:1], params, prefix="first") + run(engine, prompts[1:], params)
        return [[(e.token_id, e.logprob, *e.top) for e in o.request.logprobs] for o in outs]

    cold = numbers(make_engine(model, kv_cache_dtype="bfloat16", enable_prefix_caching=False))
    engine = make_engine(model, kv_cache_dtype="bfloat16")
    hits = hit_counter(engine)
    warm = numbers(engine)
    assert engine.paged_kv.spec.dtype == torch.bfloat16 and sum(h for _, h in hits) >= 4 * 32
    if kernels == "c":
        assert warm == cold
    else:
        assert [[t[0] for t in o] for o in warm] == [[t[0] for t in o] for o in cold]
        torch.testing.assert_close(torch.tensor([[t[1] for t in o] for o in warm]),
                                   torch.tensor([[t[1] for t in o] for o in cold]), rtol=1e-4, atol=1e-4)
