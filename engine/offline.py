"""The offline Python API: ``LLM(model=...).generate(prompts, params)``."""

import itertools

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.utils.heap import freeze_startup_heap
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams


class LLM:
    """Runs a batch of prompts to completion with continuous batching.

    >>> llm = LLM()  # the default model
    >>> llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))[0].text
    """

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **kwargs):
        if config is None:
            model_kw = {k: kwargs.pop(k) for k in ("dtype", "device", "max_model_len", "seed", "num_threads", "quantization")
                        if k in kwargs}
            cache_kw = {k: kwargs.pop(k) for k in ("block_size", "num_blocks", "enable_prefix_caching", "kv_cache_dtype")
                        if k in kwargs}
            sched_kw = {k: kwargs.pop(k) for k in ("max_num_seqs", "max_num_batched_tokens") if k in kwargs}
            parallel = ParallelConfig(kwargs.pop("tensor_parallel_size", 1))
            if kwargs:
                raise TypeError(f"unknown arguments: {sorted(kwargs)}")
            config = EngineConfig(
                ModelConfig(model=model, **model_kw), CacheConfig(**cache_kw), SchedulerConfig(**sched_kw),
                parallel=parallel,
            )
        self.engine = LLMEngine(config)
        freeze_startup_heap()
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stops the tensor-parallel workers (``tensor_parallel_size`` > 1); they also end with this process."""
        self.engine.close()

    def generate(
        self, prompts: list[str | list[int]] | str, params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[CompletionOutput]:
        prompts = [prompts] if isinstance(prompts, str) else prompts
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.engine.add_request(f"offline-{next(self._ids)}", p, sp) for p, sp in zip(prompts, params_list)]
        while self.engine.has_unfinished():
            self.engine.step()
        return [
            CompletionOutput(
                r.request_id, r.prompt_token_ids, r.output_token_ids, r.output_text, r.finish_reason, r.logprobs,
                r.prompt_logprobs,
            )
            for r in reqs
        ]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> CompletionOutput:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.generate([self.engine.tokenize(text)], params)[0]
