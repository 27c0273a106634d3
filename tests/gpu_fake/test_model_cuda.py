"""The model on fake CUDA: loading straight into the serving dtype, rope of every kind,
and a bf16 forward through each CUDA attention backend."""

import pytest
import torch

from engine.attention import SeqSpec
from engine.attention.backends import BACKENDS
from engine.layers.rotary import RotaryEmbedding
from engine.worker.loader import load_model
from engine.models.decoder import LlamaForCausalLM, head_dim_of
from kvcache.tensors import KVSpec, PagedKV
from tests.gpu_fake.fake_cuda import fake_cuda, value
from tests.gpu_fake.flash_attn_sdist import real_flash_attn
from tests.parallel.checkpoints import save_random_llama

CUDA = torch.device("cuda")
ROPES = {  # transformers' scaled rope types, as Llama 3.x, Qwen and long-context fine-tunes write them
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    "linear": dict(rope_type="linear", factor=2.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
}
# A prefill chunk after context, a decode, a chain and a tree, in one step.
SPECS = [SeqSpec(0, 7, [0]), SeqSpec(5, 1, [1]), SeqSpec(9, 3, [2]), SeqSpec(4, 4, [3], (-1, 0, 0, 1))]
BLOCK = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_llama(tmp_path_factory.mktemp("llama"))


def step_inputs(specs, vocab: int, device):
    ids = torch.randint(0, vocab, (sum(s.query_len for s in specs),), generator=torch.Generator().manual_seed(0))
    depths = [torch.arange(s.query_len) if s.parents is None else torch.tensor([0, 1, 1, 2]) for s in specs]
    positions = torch.cat([s.context_len + d for s, d in zip(specs, depths)])
    return ids.to(device), positions.to(device)


def forward(model, backend: str, device, block_size: int = BLOCK):
    """One step of ``SPECS`` through ``backend`` -> hidden states [T, hidden] and logits."""
    attn = model.layers[0].self_attn
    dtype = next(model.parameters()).dtype
    kv = PagedKV(KVSpec(len(model.layers), attn.num_kv_heads, attn.head_dim, block_size, dtype), 4, device)
    meta = BACKENDS[backend].build_metadata(SPECS, block_size, device)
    ids, positions = step_inputs(SPECS, model.config.vocab_size, device)
    with torch.inference_mode():
        hidden = model(ids, positions, meta, kv)
        return hidden, model.compute_logits(hidden)


def cpu_copy(model) -> LlamaForCausalLM:
    """A float32 CPU model with ``model``'s weights (a fake CUDA model's values), not prepacked."""
    copy = LlamaForCausalLM(model.config)
    copy.load_state_dict({k: value(v).float() for k, v in model.state_dict().items()})
    return copy.eval()


@pytest.mark.parametrize("rope", ROPES)
def test_scaled_rope_loads_and_runs_on_cuda(tmp_path, rope):
    path = save_random_llama(tmp_path, rope_scaling=ROPES[rope])
    with fake_cuda():
        model = load_model(path, torch.bfloat16, CUDA)
        assert model.rotary.cos.device.type == "cuda" and model.rotary.cos.dtype == torch.float32
        reference = RotaryEmbedding(model.config, head_dim_of(model.config), model.config.max_position_embeddings)
        torch.testing.assert_close(value(model.rotary.cos), reference.cos)
        torch.testing.assert_close(value(model.rotary.sin), reference.sin)
        hidden, logits = forward(model, "torch_varlen", CUDA)
        assert hidden.device.type == "cuda" and logits.shape == (15, model.config.vocab_size)


def test_loading_holds_the_serving_dtype_only(checkpoint):
    """Built on meta, materialized in bf16: the load's peak is the bf16 weights (plus the
    rope tables and one checkpoint tensor in flight), never a float32 copy of them."""
    with fake_cuda() as gpu:
        model = load_model(checkpoint, torch.bfloat16, CUDA)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        tables = sum(b.numel() * b.element_size() for b in model.buffers())
        assert all(p.dtype == torch.bfloat16 and p.device.type == "cuda" for p in model.parameters())
        largest = max(p.numel() for p in model.parameters()) * 4  # one float32 checkpoint tensor on its way
        assert gpu.peak <= weights + tables + largest, (gpu.peak, weights)


def test_loading_fills_every_parameter(checkpoint, tmp_path):
    """Nothing is left as uninitialized memory: a checkpoint missing a weight fails the load."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(ValueError, match="post_attention_layernorm"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("backend", ["torch", "torch_varlen", "flash_attn"])
def test_bf16_forward_on_each_cuda_backend(checkpoint, backend):
    """The step's hidden states stay on the GPU, in bf16, with no host sync inside the forward;
    flash_attn through flash-attn's own interface over its checking stand-in."""
    with fake_cuda() as gpu, real_flash_attn():
        model = load_model(checkpoint, torch.bfloat16, CUDA)
        reference, _ = forward(cpu_copy(model), "torch", "cpu")
        gpu.counts.reset()
        hidden, logits = forward(model, backend, CUDA, BACKENDS[backend].block_size(BLOCK))
        assert (hidden.dtype, logits.dtype) == (torch.bfloat16, torch.float32)
        assert gpu.counts.num_syncs == 0 and gpu.counts.synchronize == 0, gpu.counts
        torch.testing.assert_close(value(hidden).float(), reference, atol=0.1, rtol=0.05)
