"""early_exit drafts on the target's own KV cache: its drafts are exactly what the
target's first layers predict, and no entry it writes survives verification."""

import torch

from engine.attention import SeqSpec, build_attention_metadata
from engine.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.models.decoder import head_dim_of
from kvcache.tensors import KVSpec, PagedKV
from tests.conftest import check_no_lost_blocks
from tests.engine_core.engine_helpers import greedy

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6, 9, 3]
LAYERS = 2


def engine_for(model) -> LLMEngine:
    config = EngineConfig(
        ModelConfig(max_model_len=128, dtype="float32", device="cpu"),
        CacheConfig(num_blocks=64),
        speculative=SpeculativeConfig(
            method="early_exit", num_speculative_tokens=3, num_layers=LAYERS, verify_cost=0.05, adaptive=False
        ),
    )
    return LLMEngine(config, model=model, tokenizer=None)


@torch.inference_mode()
def fresh_prefill(model, tokens: list[int], num_layers=None) -> tuple[torch.Tensor, PagedKV]:
    """Final-normed hidden states [T, hidden] of one fresh prefill, and the cache it filled."""
    cfg = model.config
    kv = PagedKV(KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), 16, torch.float32), 8, "cpu")
    meta = build_attention_metadata([SeqSpec(0, len(tokens), list(range(8)))], 16)
    return model(torch.tensor(tokens), torch.arange(len(tokens)), meta, kv, num_layers=num_layers), kv


def test_drafts_are_the_first_layers_greedy_predictions(tiny_model):
    model = tiny_model(num_hidden_layers=4)
    engine = engine_for(model)
    rounds = []
    propose = engine.speculator.drafter.propose

    def record(slots):
        drafts = propose(slots)
        rounds.extend((list(s.request.token_ids), drafts[s.request.request_id].token_ids) for s in slots)
        return drafts

    engine.speculator.drafter.propose = record
    engine.add_request("r", PROMPT, greedy(12))
    while engine.has_unfinished():
        engine.step()
    assert len(rounds) >= 3
    for context, drafts in rounds:
        hidden, _ = fresh_prefill(model, context + drafts[:-1], num_layers=LAYERS)
        want = model.compute_logits(hidden[len(context) - 1 :]).argmax(-1).tolist()
        assert drafts == want


def test_verification_overwrites_every_entry_the_drafter_wrote(tiny_model):
    model = tiny_model(num_hidden_layers=4)
    engine = engine_for(model)
    req = engine.add_request("r", PROMPT, greedy(20))
    drafted = []
    engine.stat_loggers.append(lambda s: drafted.append(s.spec.num_draft_tokens))
    for _ in range(6):
        engine.step()
    assert sum(drafted) > 0 and not req.is_finished
    tokens = req.token_ids[: req.num_computed_tokens]  # every token whose K/V the target committed
    _, want = fresh_prefill(model, tokens)
    slots = torch.tensor([engine.kv_manager.block_table(req.request_id)[p // 16] * 16 + p % 16 for p in range(len(tokens))])
    for layer in range(model.config.num_hidden_layers):
        for got, ref in zip(engine.paged_kv.layer(layer), want.layer(layer)):
            got = got.view(-1, *got.shape[2:])[slots]
            torch.testing.assert_close(got, ref.view(-1, *ref.shape[2:])[: len(tokens)], rtol=1e-4, atol=1e-5)
    while engine.has_unfinished():
        engine.step()
    check_no_lost_blocks(engine)


def test_the_draft_cost_counts_the_head():
    from engine.models.decoder import LlamaForCausalLM
    from transformers import LlamaConfig

    from drafters.early_exit import _cost_per_token

    cfg = LlamaConfig(vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    layer = sum(p.numel() for p in model.layers[0].parameters())
    head = 1000 * 16
    assert _cost_per_token(model, 1) == (layer + head) / (4 * layer + head)
