"""What a checkpoint brings besides its weights: its generation config (EOS ids, default
sampling), its dtype choice (``--dtype``), and the draft models it accepts (the same
tokenizer, whatever the embedding padding; another tokenizer refused, naming both)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.config
from engine.config import SpeculativeConfig
from engine.worker.loader import load_model
from tests.engine_core.engine_helpers import prompt_logits
from tests.models.families import GENERATION_EOS
from tests.models.family_engines import PROMPTS, family_engine, greedy_tokens


def test_eos_ids_and_sampling_defaults_come_from_the_generation_config(tiny_checkpoint):
    engine = family_engine(tiny_checkpoint("llama3"))
    assert set(GENERATION_EOS) <= engine.eos_token_ids  # generation_config.json's list, not only config.json's
    assert engine.sampling_defaults == {"temperature": 0.6, "top_p": 0.9}


def test_a_generation_config_eos_ends_the_request(tiny_checkpoint, tmp_path):
    """A token that only generation_config.json names as EOS stops greedy decoding there."""
    path = tmp_path / "eos"
    shutil.copytree(tiny_checkpoint("qwen3"), path)
    engine = family_engine(path)
    first = greedy_tokens(engine, PROMPTS[:1], max_tokens=8)[0]
    eos = first[3]
    assert eos not in first[:3]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    engine = family_engine(path)
    from engine.sampling_params import SamplingParams

    req = engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert req.output_token_ids == first[:4] and req.finish_reason == "stop"


def test_bfloat16_on_a_cpu_without_avx512_bf16_is_refused_at_start_up(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(engine.config, "cpu_has_bf16", lambda: False)
    with pytest.raises(ValueError, match="AVX512-BF16"):
        family_engine(tiny_checkpoint("mistral"), dtype="bfloat16")
    with pytest.raises(ValueError, match="float16 needs a CUDA device"):
        family_engine(tiny_checkpoint("mistral"), dtype="float16")
    assert family_engine(tiny_checkpoint("mistral"), dtype="auto").paged_kv.spec.dtype == torch.float32


@pytest.mark.parametrize("name", ["gemma2", "qwen2_moe"])
def test_bfloat16_serves_where_the_cpu_has_avx512_bf16(name, tiny_checkpoint, monkeypatch):
    """bfloat16 weights, KV cache and activations end to end (torch's CPU ops; the flag
    check patched where this CPU lacks it): logits within bfloat16's precision of float32's."""
    monkeypatch.setattr(engine.config, "cpu_has_bf16", lambda: True)
    bf16 = family_engine(tiny_checkpoint(name), dtype="bfloat16")
    assert bf16.paged_kv.spec.dtype == torch.bfloat16 and next(bf16.model.parameters()).dtype == torch.bfloat16
    assert all(len(out) == 8 for out in greedy_tokens(bf16, max_tokens=8))
    fp32 = load_model(tiny_checkpoint(name), torch.float32, torch.device("cpu"), max_positions=256)
    ours = prompt_logits(bf16.model, PROMPTS[1])
    ref = prompt_logits(fp32, PROMPTS[1])
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()


def resized_draft(draft, out, vocab: int):
    """``draft`` with its embedding and head cut or zero-padded to ``vocab`` rows."""
    shutil.copytree(draft, out)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            t = tensors[name]
            tensors[name] = torch.cat([t, t.new_zeros(max(0, vocab - t.shape[0]), t.shape[1])])[:vocab].contiguous()
    config["vocab_size"] = vocab
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("vocab", [49152 + 64, 49000], ids=["padded", "cut"])
def test_a_draft_of_another_vocabulary_size_with_the_same_tokenizer_is_exact(vocab, tiny_checkpoint, tiny_draft,
                                                                            tmp_path):
    """Qwen2.5 0.5B (151,936 rows) drafts for 7B (152,064) with one tokenizer: the draft's
    logits are fitted to the target's vocabulary; greedy output is the target's own."""
    draft = resized_draft(tiny_draft("qwen2"), tmp_path / "draft", vocab)
    spec = SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=3, adaptive=False)
    engine = family_engine(tiny_checkpoint("qwen2"), spec)
    accepted = []
    engine.stat_loggers.append(lambda s: s.spec and accepted.append(s.spec.num_accepted_tokens))
    assert greedy_tokens(engine) == greedy_tokens(family_engine(tiny_checkpoint("qwen2")))
    assert sum(accepted) > 0


def test_a_draft_with_another_tokenizer_is_refused_naming_both(tiny_checkpoint, tiny_draft, tmp_path):
    draft = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_draft("qwen3"), draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[1000:1002]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens trade ids
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    spec = SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=3)
    with pytest.raises(ValueError, match="different tokenizers") as e:
        family_engine(tiny_checkpoint("qwen3"), spec)
    assert str(draft) in str(e.value) and str(tiny_checkpoint("qwen3")) in str(e.value)
