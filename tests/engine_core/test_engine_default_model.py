"""End-to-end engine behaviour on the default model: batch invariance, seeded
sampling, the first-token distribution, preemption, chunked prefill, stops and
streaming."""

import numpy as np
import pytest

from engine.sampling_params import SamplingParams
from tests.engine_core.engine_helpers import (
    assert_distribution,
    chi_square_p_value,
    expected_probs,
    greedy,
    prompt_logits,
    run,
)

# Eight prompts of mixed lengths: short and long prefills (some over the
# batched-query limit of 64 tokens), block boundaries crossed at different steps.
MIXED_TEXTS = [
    "Hello",
    "The capital of France is",
    "Write a haiku about the ocean.",
    "In 1905, Albert Einstein published four papers that changed physics. " * 4,
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "Q: What is the boiling point of water?\nA:",
    "The mitochondria is the powerhouse of the cell. " * 9,
    "Once upon a time, a fox and a crow",
]


NUM_TOKENS = 12


@pytest.fixture(scope="module")
def mixed_prompts(default_tokenizer):
    prompts = [default_tokenizer.encode(t, add_special_tokens=False) for t in MIXED_TEXTS]
    lengths = sorted(map(len, prompts))
    assert lengths[0] < 4 and lengths[-1] > 64 and len(set(lengths)) == len(prompts)
    return prompts


@pytest.fixture(scope="module")
def alone_outputs(default_engine, mixed_prompts):
    """Greedy tokens of each mixed prompt, each run alone (the reference)."""
    return [run(default_engine, [p], greedy(NUM_TOKENS), prefix="alone")[0].token_ids for p in mixed_prompts]


def test_batch_of_eight_mixed_lengths_equals_each_alone(default_engine, mixed_prompts, alone_outputs):
    batch = run(default_engine, mixed_prompts, greedy(NUM_TOKENS))
    assert [r.token_ids for r in batch] == alone_outputs


def test_preemption_with_a_tiny_pool_gives_the_unpressured_outputs(make_engine, mixed_prompts, alone_outputs):
    """Four blocks of 16 tokens for four requests of two blocks each at the
    end: they preempt each other, are recomputed, and still write the same
    tokens."""
    prompts = [p for p in mixed_prompts if 4 < len(p) <= 20][:4]
    assert len(prompts) == 4
    engine = make_engine(max_model_len=64, num_blocks=4, block_size=16)
    outs = run(engine, prompts, greedy(NUM_TOKENS))
    assert engine.scheduler.num_preemptions > 0
    assert any(o.request.num_preemptions > 0 for o in outs)
    expected = [alone_outputs[mixed_prompts.index(p)] for p in prompts]
    assert [o.token_ids for o in outs] == expected
    for o in outs:  # a recomputed request streams every token once
        assert o.streamed_token_ids == o.token_ids


def test_chunked_prefill_equals_unchunked(make_engine, mixed_prompts, alone_outputs):
    long = max(mixed_prompts, key=len)
    engine = make_engine(max_num_batched_tokens=32, num_blocks=64)
    req = engine.add_request("long", long, greedy(NUM_TOKENS))
    steps_to_first_token = 0
    while not req.output_token_ids:
        engine.step()
        steps_to_first_token += 1
    assert steps_to_first_token == -(-len(long) // 32)  # one chunk of 32 per step
    while engine.has_unfinished():
        engine.step()
    assert req.output_token_ids == alone_outputs[mixed_prompts.index(long)]


def test_seeded_sampling_is_reproducible_across_batch_compositions(default_engine, mixed_prompts):
    seeded = lambda seed: SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)  # noqa: E731
    prompt = mixed_prompts[1]
    (alone,) = run(default_engine, [prompt], seeded(1), prefix="alone")
    # The same seed again, in a batch with a greedy request, an unseeded random
    # one, the same seed on another prompt, and another seed on this prompt.
    batch = run(
        default_engine,
        [mixed_prompts[0], mixed_prompts[3], prompt, mixed_prompts[7], prompt],
        [greedy(8), SamplingParams(max_tokens=8, temperature=1.0), seeded(1), seeded(1), seeded(2)],
    )
    assert batch[2].token_ids == alone.token_ids
    assert batch[4].token_ids != alone.token_ids  # the seed matters: the check above can fail


def test_first_token_frequencies_match_the_models_processed_distribution(
    make_engine, default_engine, default_tokenizer
):
    """Many requests with different seeds sample one token after the same
    prompt; their frequencies follow the processed distribution computed here
    from the model's logits."""
    prompt = default_tokenizer.encode("The", add_special_tokens=False)  # one token: cheap prefills
    kw = dict(temperature=0.8, top_p=0.9, top_k=50)
    n = 600
    engine = make_engine(max_num_seqs=300, max_num_batched_tokens=300 * len(prompt), num_blocks=320)
    params = [SamplingParams(max_tokens=1, seed=1000 + i, **kw) for i in range(n)]
    outs = run(engine, [prompt] * n, params)
    samples = np.array([o.token_ids[0] for o in outs])
    logits = prompt_logits(default_engine.model, prompt)[-1].double().numpy()
    probs = expected_probs(logits, **kw)
    assert 3 < (probs > 0).sum() <= 50  # several tokens compete
    assert_distribution(samples, probs)
    # With this many samples the check tells the right distribution from near misses.
    for wrong in (dict(kw, temperature=1.0), dict(kw, top_p=0.8), dict(kw, top_k=0, top_p=0.95), dict(temperature=0.8)):
        assert chi_square_p_value(samples, expected_probs(logits, **wrong)) < 1e-4, wrong


@pytest.fixture(scope="module")
def chat_prompt(default_tokenizer):
    text = default_tokenizer.apply_chat_template(
        # (Asked "What is the capital of France?", the Q4_1 weights answer "L'Étoile, la Marseillaise, ...":
        # llama.cpp on the same file says the same; asked this way, they end with EOS.)
        [{"role": "user", "content": "Name the capital of France."}], add_generation_prompt=True, tokenize=False
    )
    return default_tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def chat_answer(default_engine, chat_prompt):
    """The greedy answer past its EOS ("The capital of France is Paris.<|im_end|>...")."""
    (out,) = run(default_engine, [chat_prompt], greedy(16), prefix="full")
    return out


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_spanning_tokens(default_engine, default_tokenizer, chat_prompt, chat_answer):
    full = chat_answer
    pieces = [decode(default_tokenizer, full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    assert pieces[-1] == full.text
    # A stop string made of the end of one token and the start of the next,
    # at its first occurrence in the text.
    stop = None
    for j in range(1, len(pieces) - 1):
        boundary = len(pieces[j - 1])
        candidate = full.text[boundary - 2 : boundary + 2]
        if len(candidate) == 4 and full.text.find(candidate) == boundary - 2 and len(pieces[j]) - boundary >= 2:
            stop, at = candidate, boundary - 2
            break
    assert stop is not None, f"no stop string spans two tokens in {full.text!r}"

    excluded, included, listed = run(
        default_engine,
        [chat_prompt] * 3,
        [
            greedy(16, stop=[stop]),
            greedy(16, stop=[stop], include_stop_str_in_output=True),
            greedy(16, stop=["this never appears", stop]),
        ],
    )
    assert excluded.text == full.text[:at]
    assert included.text == full.text[: at + len(stop)]
    assert listed.text == full.text[:at]
    for out in (excluded, included, listed):
        assert out.finish_reason == "stop"
        assert out.token_ids == full.token_ids[: len(out.token_ids)]
        # Generation ends at the token that completes the stop string.
        assert stop in decode(default_tokenizer, out.token_ids)
        assert stop not in decode(default_tokenizer, out.token_ids[:-1])
        # Streaming never showed the stop string, and the deltas add up to the text.
        assert out.streamed_text == out.text
        assert out.streamed_token_ids == out.token_ids


def test_stop_token_ids_max_tokens_and_eos(default_engine, default_tokenizer, chat_prompt, chat_answer):
    full = chat_answer
    eos = default_tokenizer.eos_token_id
    assert eos in full.token_ids[:-1], "the default model should end this answer with EOS"
    stop_tok = full.token_ids[3]
    first = full.token_ids.index(stop_tok)
    by_id, by_len, by_eos = run(
        default_engine,
        [chat_prompt] * 3,
        [greedy(16, stop_token_ids=[stop_tok]), greedy(5), SamplingParams(max_tokens=16, temperature=0.0)],
    )
    assert by_id.token_ids == full.token_ids[: first + 1] and by_id.finish_reason == "stop"
    assert by_len.token_ids == full.token_ids[:5] and by_len.finish_reason == "length"
    end = full.token_ids.index(eos)
    assert by_eos.token_ids == full.token_ids[: end + 1] and by_eos.finish_reason == "stop"
    assert by_eos.text == decode(default_tokenizer, full.token_ids[:end])
    for out in (by_id, by_len, by_eos):
        assert out.streamed_text == out.text
        assert out.deltas[-1].num_output_tokens == len(out.token_ids)


def test_streamed_multibyte_characters_are_never_broken(default_engine, default_tokenizer):
    prompt = default_tokenizer.encode("Here are some emojis: 😀 😃 😄", add_special_tokens=False)
    (out,) = run(default_engine, [prompt], greedy(12))
    # The model writes emojis split over two tokens each.
    assert any("\ufffd" in default_tokenizer.decode([t]) for t in out.token_ids)
    assert any(ord(c) > 0xFFFF for c in out.text)
    assert out.text == default_tokenizer.decode(out.token_ids)
    assert out.streamed_text == out.text
    assert all("\ufffd" not in d.new_text for d in out.deltas)
    assert any(d.new_token_ids and not d.new_text for d in out.deltas)  # held back mid-character


def test_abort_frees_blocks_of_running_and_waiting_requests(make_engine, mixed_prompts):
    engine = make_engine(max_num_seqs=2, num_blocks=64)
    free = engine.kv_manager.num_free_blocks
    for i, p in enumerate(mixed_prompts[:3]):
        engine.add_request(f"a{i}", p, greedy(30))
    for _ in range(3):
        engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["a0", "a1"]
    assert engine.kv_manager.num_free_blocks < free
    running = engine.abort_request("a0")
    waiting = engine.abort_request("a2")
    assert running.finished and running.finish_reason == "abort" and len(running.new_token_ids) == 0  # already streamed
    assert waiting.finished and waiting.finish_reason == "abort" and waiting.num_output_tokens == 0
    assert engine.abort_request("a2") is None  # unknown now
    assert engine.kv_manager.num_free_blocks == free - len(engine.kv_manager.block_table("a1"))
    engine.abort_request("a1")
    assert not engine.has_unfinished() and engine.kv_manager.num_free_blocks == free


def test_readme_chat_example_answers_as_documented(default_engine, default_tokenizer):
    """The README's chat question, asked of the default model as the README serves it, gets the
    answer docs/serving.md prints for it (a new user's first request)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme, serving = (root / "README.md").read_text(), (root / "docs" / "serving.md").read_text()
    (question,) = set(re.findall(r'"content": "([^"]+)"\}\]', readme))
    assert question in serving
    (answer,) = re.findall(r"print\(chat\.choices\[0\]\.message\.content\)  # (.+)", serving)
    text = default_tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                 tokenize=False)
    (out,) = run(default_engine, [default_tokenizer.encode(text, add_special_tokens=False)], greedy(32, ignore_eos=False),
                 prefix="readme")
    assert out.text == answer
