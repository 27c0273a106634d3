"""The specserve engine: scheduler, runner, sampler, model definitions."""

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.offline import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
