"""train-eagle's pieces on a tiny target: the training-time-test loss learns, the head
it writes is read by the loader and drafts without changing greedy output, and the
saved training state resumes exactly; the same end to end on a quantized target with a
tied head. The trained head of the default model (or, when none exists, one trained here
for a few steps) keeps greedy output identical too."""

import json
from pathlib import Path

import pytest
import torch

from engine.layers import quant
from training.eagle_train import TrainConfig, _load_state, _restore, _save, new_head, train, training_step, ttt_loss
from engine.models.decoder import head_dim_of
from kvcache.tensors import KVSpec, PagedKV
from tests.spec.eagle_heads import PROMPTS, eagle_engine, run, small_target

TRAINED = Path("~/.cache/specserve/heads/SmolLM2-135M-Instruct-eagle3").expanduser()


@torch.no_grad()
def fresh_pass(target, batch: torch.Tensor, layers):
    """batch [B, N] -> one fresh prefill per row: features [B, N, F], next-token probs [B, N, vocab]."""
    from engine.attention import SeqSpec, build_attention_metadata

    B, N = batch.shape
    cfg, per = target.config, -(-N // 16)
    kv = PagedKV(KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), 16, torch.float32), B * per, "cpu")
    meta = build_attention_metadata([SeqSpec(0, N, list(range(i * per, (i + 1) * per))) for i in range(B)], 16)
    hidden, feats = target(batch.reshape(-1), torch.arange(N).repeat(B), meta, kv, capture=layers)
    return feats.view(B, N, -1), torch.softmax(target.compute_logits(hidden), dim=-1).view(B, N, -1)


def batch_and_labels(target, head, seed=0):
    """Random sequences [2, 32], their features and the target's distributions over the draft vocabulary."""
    batch = torch.randint(0, 16, (2, 32), generator=torch.Generator().manual_seed(seed))
    feats, probs = fresh_pass(target, batch, head.feature_layers)
    probs = probs[..., head.draft_to_target]
    return batch, feats, probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16"])
def test_training_lowers_the_loss_and_writes_a_head_the_engine_drafts_with(tmp_path, bf16):
    target = small_target()
    head = new_head(target, torch.arange(0, 16, 2))
    batch, feats, probs = batch_and_labels(target, head)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss, accs = training_step(head, opt, feats, batch, probs, 3, bf16)
        losses.append(loss.item())
    assert len(accs) == 3 and losses[-1] < 0.7 * losses[0]
    _save(tmp_path, head, opt, head.draft_to_target, {"steps": [0], "loss": losses[:1], "acc": [accs], "elapsed_s": 0})
    assert (tmp_path / "loss.png").is_file()
    assert run(eagle_engine(target, "eagle3", tmp_path), PROMPTS) == run(eagle_engine(target), PROMPTS)


def test_a_new_heads_layer_starts_as_the_targets_last_layer_reading_its_hidden_input():
    """With the embedding's half of q, k and v at zero, the head's layer over hidden inputs x
    computes what the target's last layer computes over x (causal attention over x)."""
    from engine.attention import SeqSpec, build_attention_metadata
    from training.eagle_train import ttt_attention

    target = small_target()
    head = new_head(target, torch.arange(0, 16, 2))
    H, n = target.config.hidden_size, 10
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for proj in (head.q_proj, head.k_proj, head.v_proj):
            proj.weight[:, :H] = 0
        residual, inp = head.layer_inputs(torch.arange(n) % 16, x)
        q, k, v = head.qkv(inp, torch.arange(n))
        out = head.finish(residual, ttt_attention(q[None], [k[None]], [v[None]])[0])
        cfg = target.config
        kv = PagedKV(KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), 16, torch.float32), 1, "cpu")
        meta = build_attention_metadata([SeqSpec(0, n, [0])], 16)
        ropes = {kind: rope(torch.arange(n), x.dtype) for kind, rope in target.rotaries.items()}
        want = target.layers[-1](ropes, x, meta, kv)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_the_saved_state_resumes_exactly(tmp_path):
    target = small_target()
    head = new_head(target, torch.arange(0, 16, 2))
    batch, feats, probs = batch_and_labels(target, head)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(2):
        opt.zero_grad()
        ttt_loss(head, feats, batch, probs, steps=2)[0].backward()
        opt.step()
    history = {"steps": [0, 1], "loss": [1.0, 0.5], "acc": [[0.1], [0.2]], "elapsed_s": 1.0}
    _save(tmp_path, head, opt, head.draft_to_target, history)
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


@pytest.fixture(scope="module")
def default_head(tmp_path_factory) -> Path:
    """The trained head of the default model where one exists; else a head trained here for a
    few steps on a few chats (``train`` on the Q4_1 default, its head the quantized embedding)."""
    if TRAINED.is_dir():
        return TRAINED
    cfg = TrainConfig(out=str(tmp_path_factory.mktemp("head")), max_steps=4, batch_size=2, seq_len=64,
                      draft_vocab=2048, answer_tokens=16, prompts=20, save_every=2, eval_every=2,
                      eval_sequences=2, bf16=False)
    return train(cfg)


@pytest.mark.slow
def test_the_trained_head_keeps_greedy_output_on_the_default_model(make_engine, default_engine, default_head):
    from engine.config import SpeculativeConfig

    tok = default_engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is a prime number?", "Write a haiku about rivers.")]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    spec = SpeculativeConfig(method="eagle3", model=str(default_head), num_speculative_tokens=4, verify_cost=0.05)
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


def test_distillation_prompts_are_distinct_and_span_the_kinds_of_chat():
    from training.eagle_prompts import distillation_prompts

    prompts = distillation_prompts()
    assert len(prompts) == len(set(prompts)) == 2506
    for start in ("Explain ", "Compose a short poem", "Pretend you are", "Solve the equation", "Summarize the following",
                  "Write a C++ function"):
        assert sum(p.startswith(start) for p in prompts) >= 10, start


def test_the_default_half_of_the_prompts_keeps_every_kind_of_chat_in_its_share():
    from training.eagle_prompts import distillation_prompts
    from training.eagle_train import TrainConfig, random_subset

    prompts = distillation_prompts()
    half = random_subset(prompts, TrainConfig(out="unused").prompts)
    assert len(half) == len(set(half)) == 1253 and set(half) <= set(prompts)
    assert [prompts.index(p) for p in half] == sorted(prompts.index(p) for p in half)
    kinds = [f"Write a {lang} function" for lang in ("Python", "JavaScript", "C++", "Java")]
    kinds += ["Explain ", "Compose a short poem", "Write a limerick", "Pretend you are", "Solve the equation",
              "Summarize the following", "What is the sum"]
    for start in kinds:  # a stride of 2 would keep none of two languages and of half the forms of writing
        share = sum(p.startswith(start) for p in prompts) / 2
        assert 0.5 * share <= sum(p.startswith(start) for p in half) <= 1.5 * share, start
    assert random_subset(prompts, 5000) == prompts


def distilled_chats(target, eos=frozenset()):
    from training.eagle_data import distill

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12]]
    return prompts, distill(target, prompts, 12, (1, 3, 4), set(eos), batch=2)


def test_distillation_captures_what_a_fresh_pass_over_each_finished_chat_computes():
    """Answers decoded greedily a token a pass, three prompts in batches of two; each chat's
    features and labels as one prefill over the whole chat gives them."""
    target = small_target()
    prompts, data = distilled_chats(target)
    assert data.starts.tolist() == [0, 3 + 12, 3 + 12 + 7 + 12, 3 + 12 + 7 + 12 + 2 + 12]  # 12 answer tokens each
    for c, prompt in enumerate(prompts):
        pos = data.positions([c])
        chat = data.tokens[pos]
        assert chat[: len(prompt)].tolist() == prompt
        feats, probs = fresh_pass(target, chat[None], (1, 3, 4))
        assert (chat[len(prompt) :] == probs[0, len(prompt) - 1 : -1].argmax(-1)).all()  # greedy
        torch.testing.assert_close(data.feats[pos].float(), feats[0], atol=3e-2, rtol=1e-2)  # bfloat16
        top = probs[0].topk(data.top_ids.shape[1])
        assert (data.top_ids[pos] == top.indices).all()
        torch.testing.assert_close(data.top_p[pos].float(), top.values, atol=1e-3, rtol=1e-3)  # float16


def test_a_chat_ends_with_its_eos_and_the_eos_has_features():
    target = small_target()
    prompts, free = distilled_chats(target)
    free_answer = free.tokens[free.positions([1])][len(prompts[1]) :].tolist()
    eos = free_answer[2]  # chat 1's third answer token
    _, data = distilled_chats(target, {eos})
    for c, prompt in enumerate(prompts):
        answer = data.tokens[data.positions([c])][len(prompt) :].tolist()
        assert len(answer) == 12 and eos not in answer or answer.index(eos) == len(answer) - 1
    assert len(data.positions([1])) == len(prompts[1]) + free_answer.index(eos) + 1
    assert len(data.feats) == len(data.tokens) == len(data.top_ids)


def test_windows_cut_the_chats_in_order_with_their_labels_over_the_draft_vocabulary(tmp_path):
    from training.eagle_data import Distilled
    from training.eagle_train import Windows

    target = small_target()
    _, data = distilled_chats(target)
    data.save(tmp_path / "d.safetensors")
    data = Distilled.load(tmp_path / "d.safetensors")
    draft_ids = torch.arange(0, 16, 2)
    w = Windows(data, [2, 0], 8, draft_ids, 16)
    stream = torch.cat([data.tokens[data.positions([2])], data.tokens[data.positions([0])]])  # 14 + 15 tokens
    assert len(w) == 3
    tokens, feats, p = w.batch([2, 0])
    assert tokens.tolist() == [stream[16:24].tolist(), stream[:8].tolist()]
    pos = torch.cat([data.positions([2]), data.positions([0])])[16:24]
    torch.testing.assert_close(feats[0], data.feats[pos].float())
    _, probs = fresh_pass(target, data.tokens[data.positions([0])][None], (1, 3, 4))
    full = probs[0, 2:10, draft_ids]  # window 2 starts at token 16 of the stream: chat 0's token 2
    torch.testing.assert_close(p[0], full / full.sum(-1, keepdim=True), atol=2e-3, rtol=2e-3)  # all 16 tokens kept


def test_the_learning_rate_warms_up_then_falls_along_a_cosine_to_a_tenth():
    from training.eagle_train import TrainConfig, learning_rate

    cfg = TrainConfig(out="unused", lr=1e-3, warmup=10)
    assert learning_rate(cfg, 0, 0.0) == pytest.approx(1e-4)  # step 1 of 10 of the warm-up
    assert learning_rate(cfg, 9, 0.0) == pytest.approx(1e-3)
    assert learning_rate(cfg, 500, 0.5) == pytest.approx(0.55e-3)
    assert learning_rate(cfg, 900, 1.0) == learning_rate(cfg, 900, 1.7) == pytest.approx(1e-4)


def test_held_out_agreement_is_the_mean_over_every_sequence_whatever_the_batching():
    from training.eagle_train import Windows, agreement

    target = small_target()
    head = new_head(target, torch.arange(0, 16, 2))
    _, data = distilled_chats(target)
    w = Windows(data, [0, 1, 2], 12, head.draft_to_target, 16)
    assert len(w) == 4  # 15 + 19 + 14 tokens
    tokens, feats, probs = w.batch([0, 1, 2, 3])
    whole = ttt_loss(head, feats, tokens, probs, steps=2)[1]
    for batch in (1, 2, 3, 4):
        assert agreement(head, w, steps=2, batch=batch) == pytest.approx(whole)


@pytest.mark.skipif(quant.load() is None, reason="no CPU kernels here (AVX2, a C compiler)")
def test_train_eagle_on_a_quantized_target_with_a_tied_head(tmp_path):
    """``train`` end to end (distillation, training, the saved head) on a GGUF target whose
    matrices are Q4_1 and whose head is its Q4_1 embedding, as the default model's: the new
    head starts from their dequantized rows; the engine then drafts with it, greedy unchanged."""
    from engine.worker.loader import load_model
    from tests.quant.gguf_models import tiny_llama, write_gguf

    model = tiny_llama(layers=4)
    model.config.max_position_embeddings = 2048  # the distillation prompts, one token a byte
    path = write_gguf(model, tmp_path / "tiny.gguf", head=None, embed="Q4_1")
    cfg = TrainConfig(out=str(tmp_path / "head"), model=str(path), max_steps=4, batch_size=2, seq_len=16,
                      draft_vocab=64, answer_tokens=8, prompts=20, save_every=2, eval_every=2, eval_sequences=2,
                      bf16=False)
    out = train(cfg)
    assert len(json.loads((out / "train_log.json").read_text())["steps"]) == 4
    target = load_model(path, torch.float32, torch.device("cpu"))
    assert target.lm_head.weight.is_meta and target.layers[0].mlp.gate_up_proj.qweight is not None  # served quantized
    prompts = [[1, 70, 80, 90, 70, 80, 90], [1, 100, 101, 102]]
    assert run(eagle_engine(target, "eagle3", out), prompts, 12) == run(eagle_engine(target), prompts, 12)
