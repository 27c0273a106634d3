"""train-eagle's pieces on a tiny target: the training-time-test loss learns, the head
it writes is read by the loader and drafts without changing greedy output, and the
saved training state resumes exactly. The trained head of the default model, when
one exists, keeps greedy output identical too."""

from pathlib import Path

import pytest
import torch

from drafters.eagle_train import _load_state, _restore, _save, new_head, target_labels, ttt_loss
from engine.models.llama import head_dim_of
from kvcache.tensors import KVSpec, PagedKV
from tests.spec.test_eagle import PROMPTS, eagle_engine, run, small_target

TRAINED = Path("~/.cache/specserve/heads/SmolLM2-135M-Instruct-eagle3").expanduser()


def batch_and_labels(target, head, seed=0):
    batch = torch.randint(0, 16, (2, 32), generator=torch.Generator().manual_seed(seed))
    cfg = target.config
    kv = PagedKV(KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), 16, torch.float32), 4, "cpu")
    feats, probs = target_labels(target, batch, head.feature_layers, head.draft_to_target, kv, 16)
    return batch, feats, probs


def test_training_lowers_the_loss_and_writes_a_head_the_engine_drafts_with(tmp_path):
    target = small_target()
    head = new_head(target, torch.arange(0, 16, 2))
    batch, feats, probs = batch_and_labels(target, head)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss, accs = ttt_loss(head, feats, batch, probs, steps=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert len(accs) == 3 and losses[-1] < 0.7 * losses[0]
    _save(tmp_path, head, opt, head.draft_to_target, {"steps": [0], "loss": losses[:1], "acc": [accs], "elapsed_s": 0})
    assert (tmp_path / "loss.png").is_file()
    assert run(eagle_engine(target, "eagle3", tmp_path), PROMPTS) == run(eagle_engine(target), PROMPTS)


def test_the_saved_state_resumes_exactly(tmp_path):
    target = small_target()
    head = new_head(target, torch.arange(0, 16, 2))
    batch, feats, probs = batch_and_labels(target, head)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(2):
        opt.zero_grad()
        ttt_loss(head, feats, batch, probs, steps=2)[0].backward()
        opt.step()
    _save(tmp_path, head, opt, head.draft_to_target, {"steps": [0, 1], "loss": [1.0, 0.5], "acc": [[0.1], [0.2]], "elapsed_s": 1.0})
    state = _load_state(tmp_path)
    twin = new_head(target, state["draft_ids"])
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=3e-3)
    _restore(twin, twin_opt, state)
    for model, o in ((head, opt), (twin, twin_opt)):  # one more step each: identical
        o.zero_grad()
        ttt_loss(model, feats, batch, probs, steps=2)[0].backward()
        o.step()
    for (name, a), b in zip(head.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.slow
@pytest.mark.skipif(not TRAINED.is_dir(), reason="no trained head: specserve train-eagle --out " + str(TRAINED))
def test_the_trained_head_keeps_greedy_output_on_the_default_model(make_engine, default_engine):
    from engine.config import SpeculativeConfig

    tok = default_engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is a prime number?", "Write a haiku about rivers.")]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    spec = SpeculativeConfig(method="eagle3", model=str(TRAINED), num_speculative_tokens=4, verify_cost=0.05)
    assert run(make_engine(speculative=spec), prompts, 48) == run(default_engine, prompts, 48)


def test_training_step_zero_computes_what_drafting_computes():
    """The loss of the training-time test's first step equals the same soft cross-entropy
    computed with the head's paged drafting pass over the same pairs."""
    from engine.attention import SeqSpec, build_attention_metadata

    target = small_target()
    head = new_head(target, torch.arange(0, 16, 2))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    batch, feats, probs = batch_and_labels(target, head)
    loss, _ = ttt_loss(head, feats, batch, probs, steps=1)
    kv = PagedKV(KVSpec(1, head.num_kv_heads, head.head_dim, 16, torch.float32), 8, "cpu")
    n = batch.shape[1] - 1
    meta = build_attention_metadata([SeqSpec(0, n, [0, 1]), SeqSpec(0, n, [2, 3])], 16)
    with torch.no_grad():
        out = head(batch[:, 1:].reshape(-1), head.fuse(feats[:, :-1].reshape(2 * n, -1)), torch.arange(n).repeat(2), meta, kv)
        logp = torch.log_softmax(head.draft_logits(out)[:, head.draft_to_target], -1).view(2, n, -1)
    torch.testing.assert_close(-(probs[:, 1:] * logp).sum(-1).mean(), loss.detach(), rtol=1e-4, atol=1e-4)


def test_distillation_prompts_are_distinct_span_the_kinds_of_chat_and_the_corpus_cuts_the_chats_in_order():
    from drafters.eagle_prompts import distillation_prompts
    from drafters.eagle_train import corpus

    prompts = distillation_prompts()
    assert len(prompts) == len(set(prompts)) == 2055
    for start in ("Explain ", "Compose a short poem", "Pretend you are", "Solve the equation", "Summarize the following",
                  "Write a C++ function"):
        assert sum(p.startswith(start) for p in prompts) >= 10, start
    chats = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert corpus(chats, 4) == [[1, 2, 3, 4], [5, 6, 7, 8]]  # the last, short piece is dropped


def test_the_learning_rate_warms_up_then_falls_along_a_cosine_to_a_tenth():
    from drafters.eagle_train import TrainConfig, learning_rate

    cfg = TrainConfig(out="unused", lr=1e-3, warmup=10)
    assert learning_rate(cfg, 0, 0.0) == pytest.approx(1e-4)  # step 1 of 10 of the warm-up
    assert learning_rate(cfg, 9, 0.0) == pytest.approx(1e-3)
    assert learning_rate(cfg, 500, 0.5) == pytest.approx(0.55e-3)
    assert learning_rate(cfg, 900, 1.0) == learning_rate(cfg, 900, 1.7) == pytest.approx(1e-4)


def test_label_cache_gives_the_targets_labels_and_keeps_them():
    from drafters.eagle_train import LabelCache

    target = small_target()
    head = new_head(target, torch.arange(0, 16, 2))
    batch, feats, probs = batch_and_labels(target, head)
    cfg = target.config
    kv = PagedKV(KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), 16, torch.float32), 4, "cpu")
    cache = LabelCache(target, batch.tolist(), head.feature_layers, head.draft_to_target, kv, 16, top=8)
    got_feats, got_p = cache.batch([1, 0])
    torch.testing.assert_close(got_feats, feats[[1, 0]], atol=2e-2, rtol=1e-2)  # kept in bfloat16
    torch.testing.assert_close(got_p, probs[[1, 0]], atol=1e-3, rtol=1e-3)  # 8 tokens: the whole draft vocabulary
    assert sorted(cache.kept) == [0, 1]
    cache.target = None  # a second draw must not run the target again
    torch.testing.assert_close(cache.batch([0])[1], got_p[1:])


def test_held_out_agreement_is_the_mean_over_every_sequence_whatever_the_batching():
    from drafters.eagle_train import LabelCache, agreement

    target = small_target()
    head = new_head(target, torch.arange(0, 16, 2))
    sequences = torch.randint(0, 16, (3, 32), generator=torch.Generator().manual_seed(3)).tolist()
    cfg = target.config
    kv = PagedKV(KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), 16, torch.float32), 8, "cpu")
    cache = LabelCache(target, sequences, head.feature_layers, head.draft_to_target, kv, 16, top=8)
    feats, probs = cache.batch([0, 1, 2])
    whole = ttt_loss(head, feats, torch.tensor(sequences), probs, steps=2)[1]
    for batch in (1, 2, 3):
        assert agreement(head, cache, steps=2, batch=batch) == pytest.approx(whole)

