"""Every family against transformers' own implementation of the same tiny random checkpoint
(float32): last-position logits within 1e-4 on three prompts (the longest past every
sliding window), 32 greedy tokens identical to ``generate``, and greedy output identical
with speculation on (prompt lookup, a draft model of the same family, token trees).
Checkpoints that no family serves are refused, naming the supported ones."""

import pytest
import torch
import transformers

from engine.config import SpeculativeConfig
from engine.worker.loader import load_model
from engine.models.registry import supported_architectures
from tests.engine_core.engine_helpers import prompt_logits
from tests.models.families import BY_NAME, FAMILIES
from tests.models.family_engines import NEW_TOKENS, PROMPTS, family_engine, greedy_tokens

NAMES = [f.name for f in FAMILIES]


def hf_model(path):
    config = transformers.AutoConfig.from_pretrained(path)
    return getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", NAMES)
def test_last_position_logits_match_transformers(name, tiny_checkpoint):
    path = tiny_checkpoint(name)
    ref_model, ours = hf_model(path), load_model(path, torch.float32, torch.device("cpu"), max_positions=256)
    for ids in PROMPTS:
        with torch.inference_mode():
            ref = ref_model(torch.tensor([ids])).logits[0, -1].float()
        got = prompt_logits(ours, ids)[-1]
        assert (got - ref).abs().max().item() < 1e-4, f"{name}, {len(ids)} tokens"
        assert ref.abs().max() > 1  # not trivially small


@pytest.fixture(scope="module")
def plain_greedy(tiny_checkpoint):
    """Family name -> our engine's greedy tokens of PROMPTS, speculation off (made once)."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = greedy_tokens(family_engine(tiny_checkpoint(name)))
        return made[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers_generate(name, tiny_checkpoint, plain_greedy):
    """One prompt at a time on transformers' side (no padding), all three in one batch on ours."""
    ref_model = hf_model(tiny_checkpoint(name))
    ref_model.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS, as ignore_eos
    for ids, ours in zip(PROMPTS, plain_greedy(name), strict=True):
        with torch.inference_mode():
            out = ref_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     temperature=None, top_p=None, top_k=None, pad_token_id=0)
        assert ours == out[0, len(ids):].tolist(), f"{name}, {len(ids)} tokens"


SPECULATION = {
    "ngram": lambda draft: SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False),
    "draft_model": lambda draft: SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=3,
                                                   adaptive=False),
    "tree": lambda draft: SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=3,
                                            tree_width=2, max_tree_nodes=6, adaptive=False),
}
# The default suite runs every drafter on one family of each kind; the rest are slow.
FAST = {"mistral", "gemma3", "qwen3_moe"}


@pytest.mark.parametrize("method", list(SPECULATION))
@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in NAMES])
def test_greedy_is_identical_with_speculation(name, method, tiny_checkpoint, tiny_draft, plain_greedy):
    engine = family_engine(tiny_checkpoint(name), SPECULATION[method](tiny_draft(name)))
    drafted, accepted = [], []
    engine.stat_loggers.append(lambda s: s.spec and (drafted.append(s.spec.num_draft_tokens),
                                                      accepted.append(s.spec.num_accepted_tokens)))
    assert greedy_tokens(engine) == plain_greedy(name)
    if method != "ngram":  # a draft of the target's own first layers agrees with it at times
        assert sum(accepted) > 0
    elif repeats_its_context(plain_greedy(name)):  # prompt lookup drafts only then
        assert sum(drafted) > 0


SHORT = 12  # tokens of the default suite's Gemma 2 run (its soft caps; the 32-token runs are slow)


@pytest.mark.parametrize("method", ["draft_model", "tree"])  # prompt lookup finds no draft in 12 tokens here
def test_gemma2_greedy_is_identical_with_speculation_short(method, tiny_checkpoint, tiny_draft):
    path = tiny_checkpoint("gemma2")
    plain = greedy_tokens(family_engine(path), max_tokens=SHORT)
    engine = family_engine(path, SPECULATION[method](tiny_draft("gemma2")))
    drafted = []
    engine.stat_loggers.append(lambda s: s.spec and drafted.append(s.spec.num_draft_tokens))
    assert greedy_tokens(engine, max_tokens=SHORT) == plain
    assert sum(drafted) > 0


def repeats_its_context(outputs: list[list[int]]) -> bool:
    """Whether some output token (but the last) already appeared before it in its sequence."""
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        seq = prompt + out
        if any(seq[i] in seq[:i] for i in range(len(prompt), len(seq) - 1)):
            return True
    return False


def test_unknown_architecture_is_refused_with_the_supported_list(tiny_checkpoint, tmp_path):
    import json
    import shutil

    path = tmp_path / "unknown"
    shutil.copytree(tiny_checkpoint("llama3"), path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["MambaForCausalLM"])  # keyed by architectures, before model_type
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        load_model(path, torch.float32, torch.device("cpu"))
    message = str(e.value)
    assert "MambaForCausalLM" in message and all(a in message for a in supported_architectures())
    assert "Gemma3ForCausalLM" in message and "MixtralForCausalLM" in message


def test_every_family_has_a_tiny_checkpoint():
    """The tests above cover every family the registry serves."""
    served = set(supported_architectures())
    assert served == {BY_NAME[n].model for n in NAMES}


def test_phi3_long_factors_match_transformers_decoding(tmp_path):
    """Past ``original_max_position_embeddings`` (24 here) each new position is rotated with
    the long factors, the committed keys left as they were: transformers' forward over its
    cache, one token at a time from a 20-token prompt to 40 tokens, gives the logits we give
    the 40 tokens in one prefill (positions 24 on would differ if we kept the short factors)."""
    import dataclasses

    from tests.models.families import save_tiny

    family = BY_NAME["phi3"]
    rope = dict(family.overrides["rope_parameters"], original_max_position_embeddings=24)
    family = dataclasses.replace(family, overrides=dict(family.overrides, original_max_position_embeddings=24,
                                                        rope_parameters=rope))
    path = save_tiny(family, tmp_path)
    ref_model, ours = hf_model(path), load_model(path, torch.float32, torch.device("cpu"), max_positions=256)
    ids = PROMPTS[2]  # 40 tokens
    mine = prompt_logits(ours, ids)
    with torch.inference_mode():
        out = ref_model(torch.tensor([ids[:20]]), use_cache=True)
        cache = out.past_key_values
        for p in range(20, 40):
            out = ref_model(torch.tensor([[ids[p]]]), past_key_values=cache, position_ids=torch.tensor([[p]]))
            cache = out.past_key_values
            assert (out.logits[0, -1] - mine[p]).abs().max().item() < 1e-4, f"position {p}"
