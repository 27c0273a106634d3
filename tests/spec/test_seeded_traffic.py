"""A seeded request writes the same tokens alone, beside 15 other requests, and after
another request cached its prompt -- on one engine, for every drafter, in the
conditions that used to leak other traffic into it:

- the measured start-up costs (``verify_cost`` None), which the engine's steps then
  keep moving (``CostTracker``): a seeded request is priced by the start-up table;
- a small token budget: prompts in chunks, and drafts competing for room in a step
  (a seeded request's slots are set aside, never cut; its first output token never
  drafts, wherever its prompt's chunks end);
- a prompt of several full blocks, shared with other requests: prefix-cache hits
  (an EAGLE head would start after the hit, with less context: a seeded request
  with a head computes its whole prompt);
- other requests moving the pooled acceptance records (the policy's and
  ``ngram+eagle``'s choice of drafter): a seeded request reads its own only;
- steps the seeded request does not run (it is the newest, and the older seeded
  requests' slots fill the budget): its pauses run on its own steps.
"""

import pytest
import torch

from engine import SamplingParams
from engine.llm_engine import LLMEngine
from tests.conftest import check_no_lost_blocks
from tests.spec.seeded_engines import BLOCK, BUDGET, DRAFTERS, PROMPT, build

SEEDED = SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True)


def others(prefix: str, n: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Traffic: greedy, sampled and (every fifth) seeded, on PROMPT (its blocks cached) and on
    longer prompts."""
    out = []
    for i in range(n):
        prompt = PROMPT + [i % 16, (3 * i) % 16] * (i % 4) if i % 3 else [(7 * i + j) % 16 for j in range(30)]
        seed = 100 + i if i % 5 == 4 else None
        params = SamplingParams(max_tokens=24 + i % 9, temperature=0.0 if i % 2 else 2.0, seed=seed, ignore_eos=True)
        out.append((f"{prefix}{i}", prompt, params))
    return out


def record_drafts(engine: LLMEngine) -> dict[str, list]:
    """Request id -> its rounds' drafts as proposed: (tokens, tree, q [n, vocab] or None)."""
    rounds: dict[str, list] = {}
    propose = engine.speculator.drafter.propose

    def recorded(slots):
        drafts = propose(slots)
        for rid, d in drafts.items():
            rounds.setdefault(rid, []).append((d.token_ids, d.parents, d.probs))
        return drafts

    engine.speculator.drafter.propose = recorded
    return rounds


def same_drafts(a: list, b: list) -> bool:
    """The same rounds, tokens and trees, and q within 1e-5 (a drafting pass's last bits may
    depend on the batch it runs in: docs/cpu.md, batch invariance; a drafter that saw other
    context, or another request's records, drafts from a q that differs far more)."""
    return len(a) == len(b) and all(
        x[:2] == y[:2] and (x[2] is None) == (y[2] is None) and (x[2] is None or torch.allclose(x[2], y[2], rtol=0, atol=1e-5))
        for x, y in zip(a, b)
    )


def serve(engine: LLMEngine, requests) -> dict[str, list[int]]:
    reqs = {rid: engine.add_request(rid, prompt, params) for rid, prompt, params in requests}
    while engine.has_unfinished():
        engine.step()
    return {rid: r.output_token_ids for rid, r in reqs.items()}


@pytest.mark.parametrize("name", DRAFTERS)
def test_a_seeded_request_writes_the_same_alone_beside_others_and_after_a_cache_hit(name, tmp_path):
    engine = build(name, tmp_path)
    assert engine.speculator.cost_tracker is not None  # the costs were measured and are tracked
    stats = []
    engine.stat_loggers.append(stats.append)
    drafts = record_drafts(engine)
    alone = serve(engine, [("s-alone", PROMPT, SEEDED)])["s-alone"]
    serve(engine, others("warm", 12))  # moves the records and the cost table, caches PROMPT
    beside = serve(engine, others("busy", 15) + [("s-beside", PROMPT, SEEDED)])["s-beside"]
    serve(engine, [("cacher", PROMPT, SamplingParams(max_tokens=2, temperature=0.0))])
    after = serve(engine, [("s-after", PROMPT, SEEDED)])["s-after"]
    assert beside == alone
    assert after == alone
    # Stricter than the tokens: every round drafted the same, from the same q.
    assert same_drafts(drafts["s-beside"], drafts["s-alone"])
    assert same_drafts(drafts["s-after"], drafts["s-alone"])
    # The scenario had its teeth: drafts verified, steps full to the budget, prefix hits.
    assert sum(s.spec.num_draft_tokens for s in stats) > 80
    assert any(s.num_scheduled_tokens >= BUDGET - 1 for s in stats)
    assert sum(s.num_prefix_cache_hits for s in stats) >= 6 * BLOCK
    check_no_lost_blocks(engine)


def test_a_seeded_request_with_a_head_writes_the_same_after_its_own_prompt_was_cached(tmp_path):
    """The prefix-cache hit alone (no other traffic, the cost table not tracked): a head
    that started after the hit would draft from less context than the first time, so a
    seeded request with a head computes its whole prompt though its blocks are cached."""
    for seed in range(4):
        engine = build("eagle3", tmp_path)
        engine.speculator.cost_tracker = None
        stats = []
        engine.stat_loggers.append(stats.append)
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        first = serve(engine, [("first", PROMPT, params)])["first"]
        again = serve(engine, [("again", PROMPT, params)])["again"]
        assert again == first
        serve(engine, [("unseeded", PROMPT, SamplingParams(max_tokens=2, temperature=0.0))])
        assert sum(s.num_prefix_cache_hits for s in stats) >= 6 * BLOCK  # the blocks were cached
        check_no_lost_blocks(engine)
