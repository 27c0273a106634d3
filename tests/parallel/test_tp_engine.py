"""The engine at ``tensor_parallel_size`` 2 (a second process, gloo): the same logits
(within 1e-4) and the same greedy text as at size 1, with plain decoding and with
every drafter, on a tiny random model and on the default model, and with a bfloat16 KV
cache. Slow: each engine starts a worker process."""

import multiprocessing

import pytest
import torch

from engine.attention import SeqSpec, build_attention_metadata
from engine.config import SpeculativeConfig
from engine.worker.loader import load_tokenizer
from engine.worker.model_store import fetch_default_model
from engine.sampling_params import SamplingParams
from tests.conftest import check_no_lost_blocks
from tests.engine_core.engine_helpers import run
from tests.parallel.checkpoints import save_first_layers, save_random_llama, tp_engine

pytestmark = pytest.mark.slow

# Repetitive prompts, so that prompt lookup finds drafts and they are accepted.
TINY_PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [100, 200, 300, 100, 200], list(range(40, 70))]
TEXT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "Paris is the capital of",
]
SPECS = {
    "ngram": lambda draft, layers: SpeculativeConfig(method="ngram", num_speculative_tokens=4, verify_cost=0.05),
    "early_exit": lambda draft, layers: SpeculativeConfig(
        method="early_exit", num_speculative_tokens=3, num_layers=layers, adaptive=False
    ),
    "draft_model": lambda draft, layers: SpeculativeConfig(
        method="draft_model", num_speculative_tokens=3, model=str(draft), adaptive=False
    ),
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(fetch_default_model())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_random_llama(tmp_path_factory.mktemp("tiny"))
    return path, save_first_layers(path, tmp_path_factory.mktemp("tiny-draft"), 2)


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    path = fetch_default_model()
    return path, save_first_layers(path, tmp_path_factory.mktemp("draft"), 8)


def greedy_ids(engine, prompts, max_tokens=24) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [f.token_ids for f in run(engine, prompts, params)]


def closed(engine):
    """Checks the engine gave every block back, stops its worker, and checks no process is left."""
    try:
        check_no_lost_blocks(engine)
    finally:
        engine.close()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("specserve-tp")]


@torch.inference_mode()
def prompt_logits(model, kv, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab], computed in KV blocks 0 and 1 (the engine is idle, prefix caching off),
    with the ``cpu`` backend's metadata, as the engine's runner and a split's other ranks build it."""
    meta = build_attention_metadata([SeqSpec(0, len(prompt), [0, 1])], 16, listed=True)
    return model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt)), meta, kv))


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_logits_and_plain_greedy_match_size_one(which, request, tokenizer):
    path, _ = request.getfixturevalue(which)
    prompts = TINY_PROMPTS if which == "tiny" else [tokenizer.encode(p) for p in TEXT_PROMPTS]
    # One thread per rank on both sides. What differs is float32 rounding of the split's partial
    # sums: on SmolLM2 (30 layers, logits up to ~30) the largest of 15 x 49152 logits moved by
    # 1.0e-4, the mean by ~1e-5; a wrong shard moves them by whole units.
    whole = tp_engine(path, 1, tokenizer, num_threads=1, enable_prefix_caching=False)
    split = tp_engine(path, 2, tokenizer, num_threads=1, enable_prefix_caching=False)
    try:
        ref = prompt_logits(whole.model, whole.paged_kv, prompts[0])
        got = prompt_logits(split.model, split.paged_kv, prompts[0])
        diff = (got - ref).abs()  # [len(prompt), vocab]
        assert diff.max().item() < (1e-4 if which == "tiny" else 2e-4)
        assert diff.mean().item() < 2e-5
        assert greedy_ids(split, prompts) == greedy_ids(whole, prompts)
        assert split.paged_kv.spec.num_kv_heads == 2  # rank 0's shard: 2 of the 3 KV heads
    finally:
        check_no_lost_blocks(whole)
        closed(split)


def test_a_bf16_kv_cache_splits_like_size_one(tiny, tokenizer):
    """``--kv-cache-dtype bfloat16`` reaches the worker's shard: rounded like rank 0's, the split's
    logits stay within 1e-3 of size 1's (the split's float32 sums in another order can round a
    key to the neighbouring bfloat16: 2e-4 on the AVX2 build); a float32 worker shard moves
    them by 6e-2."""
    path, _ = tiny
    whole = tp_engine(path, 1, tokenizer, num_threads=1, enable_prefix_caching=False, kv_cache_dtype="bfloat16")
    split = tp_engine(path, 2, tokenizer, num_threads=1, enable_prefix_caching=False, kv_cache_dtype="bfloat16")
    try:
        assert split.paged_kv.k[0].dtype == torch.bfloat16
        ref = prompt_logits(whole.model, whole.paged_kv, TINY_PROMPTS[2])
        got = prompt_logits(split.model, split.paged_kv, TINY_PROMPTS[2])
        assert (got - ref).abs().max().item() < 1e-3
        assert greedy_ids(split, TINY_PROMPTS) == greedy_ids(whole, TINY_PROMPTS)
    finally:
        check_no_lost_blocks(whole)
        closed(split)


@pytest.mark.parametrize("method", list(SPECS))
@pytest.mark.parametrize("which", ["tiny", "default"])
def test_greedy_with_each_drafter_matches_size_one(which, method, request, tokenizer):
    path, draft = request.getfixturevalue(which)
    prompts = TINY_PROMPTS if which == "tiny" else [tokenizer.encode(p) for p in TEXT_PROMPTS]
    reference = greedy_ids(tp_engine(path, 1, tokenizer), prompts)
    spec = SPECS[method](draft, 2 if which == "tiny" else 10)
    engine = tp_engine(path, 2, tokenizer, speculative=spec)
    accepted = []
    engine.stat_loggers.append(lambda stats: accepted.append(stats.spec.num_accepted_tokens))
    try:
        assert greedy_ids(engine, prompts) == reference
        assert sum(accepted) > 0  # drafts went through the split target and some were kept
    finally:
        closed(engine)


def test_the_default_gguf_file_splits_in_its_blocks(tokenizer, monkeypatch):
    """The default model's GGUF file served in its Q4_1 blocks on each rank (columns of o_proj
    and down_proj split by whole blocks of 32). The split's partial sums round differently, an
    activation that moves by one ulp across a rounding boundary changes one 8-bit code, and the
    attention of later tokens carries that on: the logits move as much as under one-ulp noise in
    the whole model's embeddings (a mean of about 0.2), far less than under q and k rows left in
    llama.cpp's rotary order (a mean of about 5). On the split, greedy text with ngram drafts
    equals plain greedy text: each row's bits do not depend on the others in its step."""
    from engine.worker import gguf_file
    from engine.worker.model_store import fetch_default_gguf

    path = fetch_default_gguf()
    prompts = [tokenizer.encode(p) for p in TEXT_PROMPTS]
    whole = tp_engine(path, 1, tokenizer, num_threads=1, enable_prefix_caching=False)
    ref = prompt_logits(whole.model, whole.paged_kv, prompts[0])  # [len(prompt), vocab]
    split = tp_engine(path, 2, tokenizer, num_threads=1, enable_prefix_caching=False)
    try:
        assert split.model.local.layers[0].self_attn.o_proj.qweight.kinds == ["Q4_1"]
        moved = (prompt_logits(split.model, split.paged_kv, prompts[0]) - ref).abs().mean().item()
        plain = greedy_ids(split, prompts)
    finally:
        check_no_lost_blocks(whole)
        closed(split)
    engine = tp_engine(path, 2, tokenizer, speculative=SPECS["ngram"](None, None))
    accepted = []
    engine.stat_loggers.append(lambda stats: accepted.append(stats.spec.num_accepted_tokens))
    try:
        assert greedy_ids(engine, prompts) == plain
        assert sum(accepted) > 0
    finally:
        closed(engine)
    monkeypatch.setattr(gguf_file, "_unpermute", lambda t, heads: t)
    broken = tp_engine(path, 1, tokenizer, num_threads=1, enable_prefix_caching=False)
    assert moved < 1.0 < (prompt_logits(broken.model, broken.paged_kv, prompts[0]) - ref).abs().mean().item()


def test_the_quantized_split_is_one_rank_adding_two_partial_sums(tokenizer, monkeypatch):
    """Why the split's greedy text on the Q4_1 default can leave size 1's: arithmetic, not a
    bug. One rank whose row-parallel layers (o_proj, down_proj) add the two ranks' partial
    products, each from that rank's own blocks, gives the split's logits bit for bit, and
    its greedy text; plain size 1 does not (its one FMA chain per output rounds otherwise,
    and an activation one ulp away can change an 8-bit code of the next layer's input)."""
    from engine.layers.linear import RowParallelLinear
    from engine.worker.loader import load_model
    from engine.worker.model_store import fetch_default_gguf
    from engine.layers.parallel import TPGroup

    path = fetch_default_gguf()
    prompts = [tokenizer.encode(p) for p in TEXT_PROMPTS]
    whole = tp_engine(path, 1, tokenizer, num_threads=1, enable_prefix_caching=False)
    plain_logits, plain_text = prompt_logits(whole.model, whole.paged_kv, prompts[0]), greedy_ids(whole, prompts)
    split = tp_engine(path, 2, tokenizer, num_threads=1, enable_prefix_caching=False)
    try:
        split_logits, split_text = prompt_logits(split.model, split.paged_kv, prompts[0]), greedy_ids(split, prompts)
        second = load_model(path, torch.float32, torch.device("cpu"), TPGroup(rank=1, size=2), 256)
        halves = {}
        for mine, first, other in zip(whole.model.layers, split.model.local.layers, second.layers):
            for get in (lambda layer: layer.self_attn.o_proj, lambda layer: layer.mlp.down_proj):
                assert get(first).qweight.kinds == ["Q4_1"]
                halves[id(get(mine))] = (get(first), get(other))

        def two_partial_sums(self, x):  # x [T, in] -> rank 0's product + rank 1's [T, out]
            a, b = halves[id(self)]
            return self.biased(a.matmul(x[:, : a.in_shard]) + b.matmul(x[:, a.in_shard :]))

        monkeypatch.setattr(RowParallelLinear, "forward", two_partial_sums)
        monkeypatch.setattr(whole.model, "fused", None)  # layer by layer, through the forward above
        emulated = prompt_logits(whole.model, whole.paged_kv, prompts[0])
        assert torch.equal(emulated, split_logits)
        assert greedy_ids(whole, prompts, max_tokens=24) == split_text
        assert not torch.equal(plain_logits, split_logits)
        assert split_text != plain_text  # these prompts leave size 1's text (the 30 layers amplify it)
    finally:
        check_no_lost_blocks(whole)
        closed(split)
