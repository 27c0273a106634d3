"""One request's drafting never disturbs another's: a plain greedy tree beside a
sampled one drafts (the fast path is the round's, not a depth's), and a drafter
failure is confined to the request it concerns -- the others keep their drafts,
their drafter state and so their random streams."""

import torch

from drafters.draft_model import ModelDrafter
from engine import SamplingParams
from engine.config import SpeculativeConfig
from tests.faults import InjectedFault
from engine.llm_engine import LLMEngine
from tests.conftest import check_no_lost_blocks, engine_config

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# Its template is cut near max_tokens, so its tree is shallower than the greedy one's.
SHORT_SAMPLED = SamplingParams(max_tokens=5, temperature=1.0, seed=1, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
PROMPTS = {"g": [1, 2, 3, 4, 5], "s": [1, 2, 3, 4, 6], "bad": [7, 8, 9, 7, 8]}


def tree_engine(tiny_model, trees: bool = True) -> LLMEngine:
    model, draft = tiny_model(vocab_size=64, seed=3), tiny_model(vocab_size=64, seed=4)
    spec = SpeculativeConfig(method="test", num_speculative_tokens=3, adaptive=False, verify_cost=0.1,
                             **(dict(tree_width=2, max_tree_nodes=14) if trees else {}))
    config = engine_config(max_model_len=256, num_blocks=128, block_size=4, speculative=spec)
    return LLMEngine(config, model=model, tokenizer=None, drafter=ModelDrafter(draft, 2, 128, 4, torch.float32, CPU, 0.1))


def serve(llm: LLMEngine, requests: dict[str, SamplingParams]) -> tuple[dict[str, list[int]], int]:
    """Runs ``requests`` (id -> params) together: (id -> output tokens, steps whose drafter failed)."""
    stats = []
    llm.stat_loggers.append(stats.append)
    reqs = {rid: llm.add_request(rid, PROMPTS[rid], p) for rid, p in requests.items()}
    while llm.has_unfinished():
        llm.step()
    check_no_lost_blocks(llm)
    assert llm.speculator.drafter.kv.num_free_blocks == llm.speculator.drafter.kv.pool.num_blocks
    return {rid: r.output_token_ids for rid, r in reqs.items()}, sum(s.spec.num_fallbacks for s in stats)


def test_a_plain_greedy_tree_beside_a_shallower_sampled_one_drafts(tiny_model):
    """The sampled request's tree ends a depth before the greedy one's: the deeper levels
    hold greedy trees only and must be drawn as the round's first level was."""
    plain, _ = serve(tree_engine(tiny_model), {"g": GREEDY})
    out, fallbacks = serve(tree_engine(tiny_model), {"g": GREEDY, "s": SHORT_SAMPLED})
    assert fallbacks == 0
    assert out["g"] == plain["g"]


def failing_for(request_id: str, propose):
    """``propose`` that raises whenever ``request_id`` is among the slots (as a drafter
    bug that one request's shape triggers), after drafting the others part-way."""

    def failing(slots):
        drafts = propose(slots)  # caches written, random numbers drawn
        if any(s.request.request_id == request_id for s in slots):
            raise InjectedFault(f"drafting {request_id} failed")
        return drafts

    return failing


def test_a_drafter_failure_leaves_the_other_requests_drafts_and_state(tiny_model):
    for trees in (False, True):
        alone, _ = serve(tree_engine(tiny_model, trees), {"s": SEEDED})
        llm = tree_engine(tiny_model, trees)
        llm.speculator.drafter.propose = failing_for("bad", llm.speculator.drafter.propose)
        freed = []
        free = llm.speculator.drafter.free
        llm.speculator.drafter.free = lambda rid: freed.append((rid, llm.has_request(rid))) or free(rid)
        out, fallbacks = serve(llm, {"s": SEEDED, "bad": GREEDY})
        assert fallbacks > 0
        assert out["s"] == alone["s"]
        assert ("s", True) not in freed  # nobody dropped the state of the request that did not fail
