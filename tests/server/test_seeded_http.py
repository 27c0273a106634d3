"""Through the HTTP API, for every drafter: a seeded completion's text is the same
alone, beside 15 concurrent requests, and after another request cached its prompt
(the engine-level conditions and their reasons: tests/spec/test_seeded_traffic.py)."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.layers import cpu_kernels
from tests.server.conftest import LiveServer, settings, wait_idle
from tests.spec.seeded_engines import DRAFTERS, PROMPT, build

# Which requests share a step here depends on timing; only the C kernels promise a row the
# same bits in any batch (docs/cpu.md), torch's ops within a tolerance, where a near-tie can flip.
pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="bitwise batch invariance needs the C kernels")

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
         "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa"]
TEXT = " ".join(WORDS[t] for t in PROMPT)  # six full blocks and a word
SEEDED = {"prompt": TEXT, "max_tokens": 40, "temperature": 1.0, "seed": 11, "ignore_eos": True}


def word_tokenizer() -> PreTrainedTokenizerFast:
    """One token per word of WORDS, the vocabulary of the test model."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token=WORDS[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def other(i: int) -> dict:
    """Unseeded traffic: greedy and sampled, on the seeded prompt's text and on others."""
    prompt = TEXT + " " + " ".join(WORDS[(5 * i + j) % 16] for j in range(i % 7)) if i % 3 else \
        " ".join(WORDS[(7 * i + j) % 16] for j in range(30))
    return {"prompt": prompt, "max_tokens": 48, "temperature": 0.0 if i % 2 else 1.0, "ignore_eos": True}


def hold_steps_until(engine, n: int, timeout: float = 60) -> None:
    """The engine steps only once ``n`` requests are in it, so that they start together
    however slowly a loaded machine's HTTP threads hand them over."""
    step, deadline = engine.step, time.monotonic() + timeout

    def held():
        if engine.scheduler.num_unfinished < n and time.monotonic() < deadline:
            time.sleep(0.005)
            return []
        engine.step = step
        return step()

    engine.step = held


def text(http, body: dict) -> str:
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# Two in the default suite (prompt lookup, both heads' kinds, trees); every drafter with -m slow.
@pytest.mark.parametrize("name", [n if n in ("ngram+eagle", "eagle3-tree") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in DRAFTERS])
def test_a_seeded_completion_is_the_same_alone_beside_others_and_after_a_cache_hit(name, tmp_path):
    engine = build(name, tmp_path, word_tokenizer())
    with LiveServer(settings(max_model_len=128), engine) as live, live.http() as http:
        alone = text(http, SEEDED)
        hold_steps_until(engine, 16)  # the seeded request and 15 others, in the engine at once
        with ThreadPoolExecutor(16) as pool:
            busy = [pool.submit(text, http, other(i)) for i in range(15)]
            beside = pool.submit(text, http, SEEDED).result()
            assert all(f.result() for f in busy)
        text(http, {"prompt": TEXT, "max_tokens": 2, "temperature": 0.0})  # caches the prompt's blocks
        after = text(http, SEEDED)
    wait_idle(engine)
    assert len(alone.split()) == 40
    assert beside == alone
    assert after == alone
