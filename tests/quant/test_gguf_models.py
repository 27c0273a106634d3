"""GGUF checkpoints served in their block formats: what stays quantized, what the model
computes against transformers' own reading of the same file, the tokenizer and chat
template from the file, refusal of a type without a kernel, the no-kernel path, and
``--quantization int8 / int4`` on a float checkpoint."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.layers import quant
from engine.layers.linear import PackedLinear
from engine.worker.loader import load_model, load_tokenizer
from tests.engine_core.engine_helpers import prompt_logits
from tests.quant.gguf_models import CHAT_TEMPLATE, tiny_llama, write_gguf

kernels = pytest.mark.skipif(quant.load() is None, reason="no CPU kernels here (AVX2, a C compiler)")
CPU, F32 = torch.device("cpu"), torch.float32
PROMPT = list(range(5, 70))


def mixed_kinds(name: str) -> str:
    """A Q4_K_M-like mix: K-quants by layer, v and down in others, and one plain F16 matrix."""
    layer = int(name.split(".")[1])
    if name.endswith("attn_v"):
        return "Q6_K" if layer == 0 else "Q8_0"
    if name.endswith("ffn_down"):
        return "Q5_K" if layer == 0 else "F16"
    return ("Q4_K", "Q4_0")[layer]


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory) -> Path:
    """Hidden 256 (a multiple of the K-quants' 256-weight blocks)."""
    model = tiny_llama(hidden=256, inter=512)
    return write_gguf(model, tmp_path_factory.mktemp("gguf") / "mixed.gguf", mixed_kinds, head="Q6_K", embed="Q8_0")


@pytest.fixture(scope="module")
def q4_1_file(tmp_path_factory) -> Path:
    return write_gguf(tiny_llama(), tmp_path_factory.mktemp("gguf") / "q4_1.gguf")


def transformers_logits(path: Path) -> torch.Tensor:
    """The reference: transformers reads the file itself, dequantizing every tensor."""
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=F32).eval()
    with torch.inference_mode():
        return model(torch.tensor([PROMPT])).logits[0]


def kinds_of(model) -> dict[str, list[str]]:
    return {n: list(m.qweight.kinds) for n, m in model.named_modules()
            if isinstance(m, PackedLinear) and m.qweight is not None}


@kernels
def test_quantized_tensors_stay_in_their_blocks(mixed_file):
    model = load_model(mixed_file, F32, CPU)
    kinds = kinds_of(model)
    assert kinds["layers.0.self_attn.qkv_proj"] == ["Q4_K", "Q6_K"]  # q and k merged, v apart
    assert kinds["layers.1.self_attn.qkv_proj"] == ["Q4_0", "Q8_0"]
    assert kinds["layers.0.mlp.down_proj"] == ["Q5_K"] and kinds["lm_head"] == ["Q6_K"]
    assert "layers.1.mlp.down_proj" not in kinds and model.layers[1].mlp.down_proj.weight.dtype == F32  # F16 file
    assert model.embed_tokens.weight.is_meta and model.layers[0].mlp.gate_up_proj.weight.is_meta


@kernels
def test_logits_match_transformers_reading_the_same_file(mixed_file):
    """Dequantized (``--quantization none``): transformers' numbers to float32 rounding; kept in
    blocks: within the 8-bit activations' error (a few percent on a random model) and the
    same argmax almost everywhere."""
    ref = transformers_logits(mixed_file)
    dequantized = prompt_logits(load_model(mixed_file, F32, CPU, quantization="none"), PROMPT)
    assert torch.allclose(dequantized, ref, atol=1e-3, rtol=1e-4)
    served = prompt_logits(load_model(mixed_file, F32, CPU), PROMPT)
    assert (served - ref).norm() / ref.norm() < 0.05
    assert (served.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_without_the_kernels_the_file_is_dequantized(q4_1_file, monkeypatch):
    """The no-kernel path (SPECSERVE_CPU_KERNELS=0, no AVX2, no compiler): float32 weights,
    exactly those of ``--quantization none``."""
    monkeypatch.setattr(quant, "load", lambda: None)
    model = load_model(q4_1_file, F32, CPU)
    assert not kinds_of(model) and not model.layers[0].self_attn.qkv_proj.weight.is_meta
    monkeypatch.undo()
    reference = load_model(q4_1_file, F32, CPU, quantization="none")
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name


def test_tokenizer_and_chat_template_come_from_the_file(q4_1_file):
    tok = load_tokenizer(q4_1_file)
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token == "<|im_end|>"
    assert tok.decode(tok.encode("the cat", add_special_tokens=False)) == "the cat"


@kernels
def test_a_type_without_a_kernel_is_refused_with_its_name(tmp_path):
    path = write_gguf(tiny_llama(), tmp_path / "q5_0.gguf", lambda n: "Q5_0" if n == "blk.1.ffn_up" else "Q4_1")
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight is Q5_0"):
        load_model(path, F32, CPU)
    load_model(path, F32, CPU, quantization="none")  # dequantized, it serves


@kernels
@pytest.mark.parametrize("mode, body", [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_a_float_checkpoint_quantized_at_load(mode, body, tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    quantized = load_model(tmp_path, F32, CPU, quantization=mode)
    kinds = kinds_of(quantized)
    assert kinds["layers.0.mlp.gate_up_proj"] == [body] and kinds["lm_head"] == ["Q8_0"]
    ref = prompt_logits(load_model(tmp_path, F32, CPU), PROMPT)
    got = prompt_logits(quantized, PROMPT)
    assert (got - ref).norm() / ref.norm() < (0.03 if mode == "int8" else 0.2)
    with pytest.raises(ValueError, match="keeps its own formats"):
        load_model(write_gguf(model, tmp_path / "m.gguf"), F32, CPU, quantization=mode)


@kernels
def test_fused_quantized_layers_give_the_bits_of_the_layer_modules(tiny_model):
    """A decode and verification step (decodes, a chain, a tree) through one C call per layer,
    its four matmuls on GGUF blocks, gives the same logits and KV cache bits as the layer
    modules' calls."""
    from engine.attention import SeqSpec, build_attention_metadata
    from tests.engine_core.engine_helpers import scratch_cache

    model = tiny_model(intermediate_size=128)
    model.prepack(quant.QUANTIZE_TO["int4"])
    fused = model.fused  # every layer's one C call, its matmuls on GGUF blocks
    assert fused is not None
    kv = scratch_cache(model, 16, 4)
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for i, n in enumerate([9, 14, 5]):  # prefill each request through the layer modules
            spec = SeqSpec(0, n, list(range(4 * i, 4 * i + 4)))
            model.fused = None
            model(torch.randint(0, 512, (n,), generator=g), torch.arange(n), build_attention_metadata([spec], 4, listed=True), kv)
        specs = [SeqSpec(9, 1, [0, 1, 2, 3]), SeqSpec(14, 2, [4, 5, 6, 7]), SeqSpec(5, 4, [8, 9, 10, 11], (-1, 0, 0, 1))]
        ids, pos = torch.randint(0, 512, (7,), generator=g), torch.tensor([9, 14, 15, 5, 6, 6, 7])
        out = {}
        for name, layers in (("modules", None), ("fused", fused)):
            model.fused = layers
            cache = scratch_cache(model, 16, 4)
            for i in range(len(model.layers)):
                for dst, src in zip(cache.layer(i), kv.layer(i)):
                    dst.copy_(src)
            out[name] = (model.compute_logits(model(ids, pos, build_attention_metadata(specs, 4, listed=True), cache)),
                         cache)
    assert torch.equal(out["modules"][0], out["fused"][0])
    for i in range(len(model.layers)):
        for a, b in zip(out["modules"][1].layer(i), out["fused"][1].layer(i)):
            assert torch.equal(a, b)
