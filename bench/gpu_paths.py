"""The device check's section on the paths that crashed before their first CUDA run
(``bench.gpu_check``, section "CUDA paths"), each on the device, small:

- a Llama 3 scaled rope checkpoint loaded and run (its tables mixed CPU and CUDA);
- logprobs under speculation, greedy and sampled (a CPU index met CUDA logprobs);
- a drafter on the device (early exit: the target's first layer drafts);
- tensor parallelism over two GPUs when two are visible (the memory profile bound
  the workers to its scratch cache).

Each row says ok or the error; the section fails when one does.
"""

import tempfile
import traceback
from pathlib import Path

import torch

from bench.common import markdown_table

TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=None,
            bos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=128)


def save_checkpoint(out: Path, **overrides) -> Path:
    """A tiny random Llama checkpoint (config.json + model.safetensors; no tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).save_pretrained(out, safe_serialization=True)
    return out


def llama3_rope(args, tmp: Path) -> str:
    from engine.attention import SeqSpec
    from engine.attention.backends import select_backend
    from engine.worker.loader import load_model
    from kvcache.tensors import KVSpec, PagedKV

    path = save_checkpoint(tmp / "llama3", rope_scaling=LLAMA3_ROPE)
    model = load_model(path, args.dtype, args.device)
    backend = select_backend("auto", args.device, args.dtype)
    block = backend.block_size(16)
    attn = model.layers[0].self_attn
    kv = PagedKV(KVSpec(len(model.layers), attn.num_kv_heads, attn.head_dim, block, args.dtype), 2, args.device)
    meta = backend.build_metadata([SeqSpec(0, 9, [0])], block, args.device)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.arange(9, device=args.device), torch.arange(9, device=args.device),
                                            meta, kv))
    assert torch.isfinite(logits).all() and model.rotary.cos.device.type == args.device.type
    return f"{backend.name}, logits {tuple(logits.shape)} finite"


def engine_config(args, speculative=None, path=None, tp: int = 1):
    from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig

    dtype = str(args.dtype).removeprefix("torch.")
    return EngineConfig(ModelConfig(model=str(path) if path else None, device=str(args.device), dtype=dtype,
                                    max_model_len=512),
                        CacheConfig(num_blocks=64), SchedulerConfig(max_num_batched_tokens=256),
                        speculative or SpeculativeConfig(), ParallelConfig(tensor_parallel_size=tp))


def engine_on(args, speculative):
    from bench.common import tiny_model
    from engine.llm_engine import LLMEngine

    return LLMEngine(engine_config(args, speculative), model=tiny_model(args.device, args.dtype))


def run_requests(engine, params_list) -> list:
    from bench.common import repetitive_prompts

    prompts = repetitive_prompts(len(params_list), 512)
    reqs = [engine.add_request(f"r{i}", p, params) for i, (p, params) in enumerate(zip(prompts, params_list))]
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
    return reqs


def logprobs_under_speculation(args, tmp: Path) -> str:
    from engine.config import SpeculativeConfig
    from engine.sampling_params import SamplingParams

    engine = engine_on(args, SpeculativeConfig(method="ngram", num_speculative_tokens=3, verify_cost=0.1))
    params = [SamplingParams(max_tokens=12, temperature=t, seed=1, logprobs=2, ignore_eos=True) for t in (0.0, 1.0)]
    for r in run_requests(engine, params):
        assert [lp.token_id for lp in r.logprobs] == r.output_token_ids
    return "greedy and sampled, 12 tokens each, a logprob per token"


def drafter_on_device(args, tmp: Path) -> str:
    from engine.config import SpeculativeConfig
    from engine.sampling_params import SamplingParams

    spec = SpeculativeConfig(method="early_exit", num_layers=1, num_speculative_tokens=3, verify_cost=0.1)
    engine = engine_on(args, spec)
    drafted = []
    engine.stat_loggers.append(lambda s: drafted.append(s.spec.num_draft_tokens if s.spec else 0))
    run_requests(engine, [SamplingParams(max_tokens=12, temperature=t, seed=2, ignore_eos=True) for t in (0.0, 1.0)])
    assert sum(drafted) > 0, "the drafter proposed nothing"
    return f"early exit (1 layer): {sum(drafted)} draft tokens verified"


def tensor_parallel(args, tmp: Path) -> str:
    from engine.distributed import load_target
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    path = save_checkpoint(tmp / "tp")
    config = engine_config(args, path=path, tp=2)
    engine = LLMEngine(config, model=load_target(path, config, args.dtype, args.device, 512))
    try:
        reqs = run_requests(engine, [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)])
    finally:
        engine.close()
    return f"tp=2 from {args.device}, {len(reqs[0].output_token_ids)} tokens"


def cuda_paths(args) -> str:
    checks = [("Llama 3 rope", llama3_rope), ("logprobs under speculation", logprobs_under_speculation),
              ("a drafter on the device", drafter_on_device)]
    if args.device.type == "cuda" and torch.cuda.device_count() > 1:
        checks.append(("tensor parallel, 2 GPUs", tensor_parallel))
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in checks:
            try:
                rows.append([name, "ok", fn(args, Path(tmp))])
            except Exception as e:  # noqa: BLE001 - each check reports on its own
                ok = False
                rows.append([name, "FAIL", f"{type(e).__name__}: {e}".replace("|", "/")[:300]])
                traceback.print_exc()
    table = markdown_table(["path", "", "what ran"], rows)
    assert ok, table
    single = "" if len(checks) == 4 else "\n\nTensor parallelism: not run (needs two CUDA devices)."
    return table + single
