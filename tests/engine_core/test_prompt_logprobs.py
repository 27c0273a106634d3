"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``) come from the
prefill pass and equal transformers' on the default model (float32), whether
the prompt is prefilled whole or in chunks, with speculation off or on (ngram
drafts verified in the same passes as the prompt's chunks)."""

import pytest
import torch
from transformers import LlamaForCausalLM

from engine import SamplingParams
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.core.request import Request
from tests.conftest import DEFAULT_MAX_MODEL_LEN, check_no_lost_blocks

ATOL = 1e-4  # the bound on a log-probability
TOP_N = 3
TEXTS = [
    "The quick brown fox jumps over the lazy dog. Then it ran into the forest, where it met a wise old owl.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5\n" * 2,
    "Hi",
]
# A copy-heavy request that keeps drafting (ngram) while the scored prompts prefill.
COPY = "one two three four five six seven eight nine ten. " * 6


@pytest.fixture(scope="module")
def hf_model(default_model_path):
    return LlamaForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    return [default_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


@pytest.fixture(scope="module")
def hf_logprobs(hf_model, prompts) -> list[torch.Tensor]:
    """Per prompt: [len - 1, vocab], row p the distribution of prompt token p + 1."""
    with torch.inference_mode():
        return [hf_model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1) for ids in prompts]


def engine(float_engine, budget: int, spec: SpeculativeConfig) -> LLMEngine:
    config = EngineConfig(
        ModelConfig(max_model_len=DEFAULT_MAX_MODEL_LEN, dtype="float32", device="cpu"),
        CacheConfig(num_blocks=128),
        SchedulerConfig(max_num_batched_tokens=budget),
        spec,
    )
    return LLMEngine(config, model=float_engine.model, tokenizer=float_engine.tokenizer)


NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, verify_cost=0.05)
CASES = {
    "whole": (512, SpeculativeConfig()),
    "chunked": (13, SpeculativeConfig()),
    "ngram": (512, NGRAM),
    "ngram-chunked": (16, NGRAM),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logprobs_match_transformers(case, float_engine, default_tokenizer, prompts, hf_logprobs):
    budget, spec = CASES[case]
    eng = engine(float_engine, budget, spec)
    drafted = []
    eng.stat_loggers.append(lambda s: drafted.append(s.spec.num_draft_tokens if s.spec else 0))
    copy = eng.add_request("copy", default_tokenizer.encode(COPY), SamplingParams(max_tokens=24, temperature=0))
    for _ in range(3 if budget > 100 else 12):  # the copy request is decoding when the scored prompts arrive
        eng.step()
    # max_tokens 0 (score only) and 2 (score, then generate), top-N and the token alone.
    params = [SamplingParams(max_tokens=m, temperature=0, prompt_logprobs=n) for m, n in ((0, TOP_N), (2, 0))]
    reqs = [eng.add_request(f"r{i}-{j}", ids, p) for i, ids in enumerate(prompts) for j, p in enumerate(params)]
    while eng.has_unfinished():
        eng.step()
    check_no_lost_blocks(eng)
    assert copy.prompt_logprobs is None and copy.num_output_tokens == 24
    if spec.method:
        assert sum(drafted) > 0
    for req in reqs:
        i = int(req.request_id[1])
        ids, ref = prompts[i], hf_logprobs[i]
        got = req.prompt_logprobs
        assert [lp.token_id for lp in got] == ids[1:]
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)]
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in got]), want, atol=ATOL, rtol=0)
        assert [lp.rank for lp in got] == (ref > want.unsqueeze(1)).sum(-1).add(1).tolist()
        n = req.params.prompt_logprobs
        for p, lp in enumerate(got):
            values, top_ids = ref[p].topk(n) if n else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
            assert [t for t, _ in lp.top] == top_ids.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values, atol=ATOL, rtol=0)
        if req.params.max_tokens == 0:
            assert req.finish_reason == "length" and req.output_token_ids == []
        else:
            assert req.num_output_tokens == 2


def test_first_delta_carries_the_prompt_logprobs(make_engine, default_tokenizer):
    eng = make_engine(max_num_batched_tokens=5)
    ids = default_tokenizer.encode(TEXTS[0], add_special_tokens=False)
    eng.add_request("a", ids, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1, ignore_eos=True))
    eng.add_request("b", ids, SamplingParams(max_tokens=3, temperature=0))
    deltas = [d for _ in range(40) if eng.has_unfinished() for d in eng.step()]
    a = [d for d in deltas if d.request_id == "a"]
    assert len(a[0].prompt_logprobs) == len(ids) - 1
    assert all(d.prompt_logprobs is None for d in a[1:]) and sum(len(d.new_token_ids) for d in a) == 3
    assert all(d.prompt_logprobs is None for d in deltas if d.request_id == "b")


def test_prompt_only_request_finishes_after_prefill(make_engine):
    eng = make_engine()
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=0))
    (delta,) = eng.step()
    assert delta.finished and delta.finish_reason == "length" and delta.new_token_ids == []
    assert delta.num_output_tokens == 0 and delta.prompt_logprobs is None
    assert not eng.has_unfinished()


def test_recomputed_prompt_keeps_its_first_logprobs():
    """A prompt prefilled again after preemption adds only the entries it lacked."""
    req = Request("r", [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=0), frozenset())
    entries = lambda start, n, v: (start, [object() for _ in range(n)])  # noqa: E731
    first = entries(0, 2, 0)
    req.add_prompt_logprobs(*first)
    again = entries(0, 4, 1)
    req.add_prompt_logprobs(*again)
    assert req.prompt_logprobs == first[1] + again[1][2:]
    req.add_prompt_logprobs(6, [object()])  # a gap: not recorded
    assert len(req.prompt_logprobs) == 4


def test_prompt_logprobs_validation():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    assert SamplingParams(prompt_logprobs=0).scores_prompt and not SamplingParams().scores_prompt


def test_a_cached_prompt_is_still_scored_whole(make_engine, default_tokenizer):
    """The prefix cache would skip a repeated prompt's full blocks: a request that scores its
    prompt computes them again, and gets the same log-probabilities as the first time."""
    eng = make_engine(enable_prefix_caching=True)
    ids = default_tokenizer.encode(TEXTS[1], add_special_tokens=False)  # several full blocks
    assert len(ids) > 2 * eng.kv_manager.block_size
    first = eng.add_request("a", ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    while eng.has_unfinished():
        eng.step()
    assert eng.kv_manager.find_cached_prefix("probe", ids)  # the cache holds the prompt's blocks
    again = eng.add_request("b", ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    while eng.has_unfinished():
        eng.step()
    assert len(again.prompt_logprobs) == len(ids) - 1
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in again.prompt_logprobs]),
                               torch.tensor([lp.logprob for lp in first.prompt_logprobs]), atol=1e-6, rtol=0)
