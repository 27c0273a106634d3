"""Which model class and ``Arch`` serve a checkpoint, chosen by its config's
``architectures`` (else its ``model_type``).

Every family runs on the shared decoder (``engine.models.decoder``); a family is
the function that reads what it changes from its config. Families that differ
from Llama only in a flag or two are written here; Gemma (``gemma``) and the
mixtures of experts (``moe``) have their own files. A checkpoint no family
handles is refused with the list of those supported.
"""

from dataclasses import dataclass
from typing import Callable

from engine.models.arch import Arch, llama_arch
from engine.models.gemma import gemma2_arch, gemma3_arch
from engine.models.moe import mixtral_arch, olmoe_arch, qwen2_moe_arch, qwen3_moe_arch


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # config.architectures entries it serves
    model_types: tuple[str, ...]  # config.model_type values, when architectures is missing
    arch: Callable[..., Arch]  # Hugging Face config -> Arch


def qwen2_arch(config) -> Arch:
    """Qwen2 / Qwen2.5: biases on q, k and v only; sliding windows where ``use_sliding_window``."""
    return llama_arch(config, qkv_bias=True, o_bias=False)


def qwen3_arch(config) -> Arch:
    """Qwen3: each q and k head rms-normed before rope."""
    return llama_arch(config, qk_norm="head")


FAMILIES = (
    Family("Llama", ("LlamaForCausalLM",), ("llama",), llama_arch),  # Llama 2, 3.x (rope llama3), SmolLM
    Family("Mistral", ("MistralForCausalLM",), ("mistral",), llama_arch),  # Llama with a sliding window
    Family("Qwen2", ("Qwen2ForCausalLM",), ("qwen2",), qwen2_arch),
    Family("Qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qwen3_arch),
    Family("Gemma 2", ("Gemma2ForCausalLM",), ("gemma2",), gemma2_arch),
    Family("Gemma 3", ("Gemma3ForCausalLM",), ("gemma3_text",), gemma3_arch),
    Family("Phi-3", ("Phi3ForCausalLM",), ("phi3",), llama_arch),  # fused qkv / gate_up tensors, longrope
    Family("Mixtral", ("MixtralForCausalLM",), ("mixtral",), mixtral_arch),
    Family("Qwen2-MoE", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), qwen2_moe_arch),
    Family("Qwen3-MoE", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), qwen3_moe_arch),
    Family("OLMoE", ("OlmoeForCausalLM",), ("olmoe",), olmoe_arch),
)


def supported_architectures() -> list[str]:
    return [a for f in FAMILIES for a in f.architectures]


def family_of(config) -> Family:
    """The family serving ``config``; ValueError naming its architectures and the supported ones."""
    names = list(getattr(config, "architectures", None) or [])
    for family in FAMILIES:
        if any(a in family.architectures for a in names):
            return family
    model_type = getattr(config, "model_type", None)
    if not names:
        for family in FAMILIES:
            if model_type in family.model_types:
                return family
    raise ValueError(
        f"model architectures {names or None} (model_type {model_type!r}) are not supported; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )


def arch_of(config) -> Arch:
    return family_of(config).arch(config)
