"""The synchronous engine: owns the model, the KV cache, the scheduler and the
runner, and advances every request by one step at a time.

Not thread-safe: one thread calls ``add_request``, ``abort_request`` and
``step`` (``AsyncEngine`` runs it on its own thread).

A request's life: ``add_request`` validates it (the one place a request is
validated) and queues it; steps run it; it ends finished (stop, length),
aborted or failed. Every end goes through ``Scheduler.finish`` (which frees its
KV blocks and records its id), and then through ``_release``, the one path that
drops what the rest of the engine holds for it: the runner's state, the
drafter's, the policy's record.
"""

import logging

import torch

from engine.attention import select_backend
from engine.attention.backends import flash_attn_status
from engine.config import EngineConfig
from engine.worker.cuda_graphs import BucketedForward, bucket_limits, graph_pool_bytes, graphs_apply
from engine.utils.devices import choose_device
from engine.distributed import TensorParallelModel, load_target
from engine.utils.faults import FaultHook
from engine.worker.gpu_memory import DrafterMemory, num_kv_blocks
from engine.worker.loader import SAMPLING_DEFAULTS, load_config, load_generation_config, load_tokenizer
from engine.worker.model_store import resolve_model
from engine.models.decoder import head_dim_of
from engine.outputs import RequestOutput
from engine.core.request import Request
from engine.worker.runner import ModelRunner
from engine.worker.sampler import grammar_bitmask
from engine.sampling_params import InvalidParameter, SamplingParams
from engine.core.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from engine.spec_decode.policy import StepPlan
from engine.spec_decode.registry import check_speculative, drafter_memory
from engine.spec_decode.speculator import build_speculator
from engine.core.stats import EngineSnapshot, StepClock, make_step_stats
from engine.core.stop import holdback
from kvcache import KVCacheManager, blocks_needed
from kvcache.tensors import KVSpec, PagedKV

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), model=None, tokenizer=None, drafter=None):
        """``model``, ``tokenizer`` and ``drafter`` may be given ready-made (tests);
        by default they are built from ``config``."""
        self.config = config
        if drafter is None:
            check_speculative(config.speculative)  # before the target loads
        self.device_choice = choose_device(config.model.device)
        log.log(logging.WARNING if self.device_choice.fell_back else logging.INFO, "device %s: %s",
                self.device_choice.device, self.device_choice.reason)
        device, dtype = self.device_choice.device, config.model.torch_dtype()
        if device.type == "cpu":
            torch.set_num_threads(config.threads_per_rank())
        model, tokenizer, generation = self._load(config, model, tokenizer, dtype, device)
        # Requests' default sampling, from the checkpoint's generation config (vLLM does the same).
        self.sampling_defaults = {k: generation[k] for k in SAMPLING_DEFAULTS if generation.get(k) is not None}
        self.model, self.tokenizer = model, tokenizer
        self.tp_workers = model.workers if isinstance(model, TensorParallelModel) else None
        hf_config = model.config
        self.max_model_len = config.model.max_model_len or hf_config.max_position_embeddings
        kv_dtype = config.cache.torch_kv_dtype(dtype)
        attention = select_backend(config.model.attention_backend, device, dtype, head_dim_of(hf_config), kv_dtype)
        if device.type == "cuda" and attention.name != "flash_attn":
            log.info("attention %s: flash-attn not used (%s)", attention.name, flash_attn_status() or "not chosen")
        block_size = attention.block_size(config.cache.block_size)
        # This rank's KV heads (all of them at tensor_parallel_size 1; test models may have no layers).
        kv_heads = model.layers[0].self_attn.num_kv_heads if hasattr(model, "layers") else hf_config.num_key_value_heads
        spec = KVSpec(hf_config.num_hidden_layers, kv_heads, head_dim_of(hf_config), block_size, kv_dtype)
        needs = (drafter_memory(config.speculative, dtype=dtype, kv_dtype=kv_dtype, block_size=block_size)
                 if drafter is None else None)
        graphs = graphs_apply(config, model, attention.name, device)
        graph_bytes = graph_pool_bytes(model, attention.name, spec, self.max_model_len, device,
                                       *bucket_limits(config)) if graphs and not config.cache.num_blocks else 0
        num_blocks = num_kv_blocks(config, spec, model, attention, device, self.max_model_len,  # GPU: engine.worker.gpu_memory
                                   needs or DrafterMemory(), graph_bytes)
        if num_blocks < blocks_needed(self.max_model_len, spec.block_size):
            raise ValueError(
                f"the KV cache holds {num_blocks * spec.block_size} tokens, fewer than max_model_len="
                f"{self.max_model_len}; raise the KV-cache budget or lower max_model_len"
            )
        self.kv_manager = KVCacheManager(num_blocks, spec.block_size, config.cache.enable_prefix_caching)
        self.paged_kv = PagedKV(spec, num_blocks, device, pad_block=graphs)
        self.runner = ModelRunner(model, self.paged_kv, spec.block_size, device, config.model.seed, attention)
        self.speculator = build_speculator(config, self.runner, drafter, tokenizer=tokenizer, num_blocks=num_blocks,
                                           dtype=dtype, kv_dtype=kv_dtype, target_path=self.model_path,
                                           max_model_len=self.max_model_len)
        self.runner.feature_layers = self.speculator.feature_layers
        if graphs and not self.runner.feature_layers:  # a drafter reading features runs every step eagerly
            self.runner.bucketed = BucketedForward(model, attention.name, self.paged_kv, self.max_model_len, device,
                                                   *bucket_limits(config), graphs=True)
            self.runner.bucketed.capture_all()
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.max_model_len)
        self.eos_token_ids = eos_token_ids_of(hf_config, tokenizer, generation)
        self.stat_loggers: list = []  # callables taking each step's StepStats
        self._grammars = None  # engine.worker.grammar.Grammars, built at the first structured request
        _log_ready(model, num_blocks, spec, device, dtype, attention.name)

    def _load(self, config: EngineConfig, model, tokenizer, dtype, device) -> tuple:
        """(model, tokenizer, generation config): the target (rank 0's shard at
        tensor_parallel_size > 1) loaded from ``config``, or the ready-made one as given."""
        if model is not None:
            self.model_path = "<in-memory>"
            return model, tokenizer, {}
        path = resolve_model(config.model.model, config.model.quantization)
        max_len = config.model.max_model_len or load_config(path).max_position_embeddings
        model = load_target(path, config, dtype, device, max_len)
        tokenizer = tokenizer or load_tokenizer(path)
        self.model_path = str(path)
        return model, tokenizer, load_generation_config(path)

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidParameter for a request the engine cannot serve."""
        if not prompt_token_ids:
            raise InvalidParameter("prompt", "must not be empty")
        vocab = self.model.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise InvalidParameter("prompt", f"token ids must be in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidParameter("logit_bias", f"keys must be token ids in [0, {vocab})")
        if params.guided is not None:
            self.grammars.compile(params.guided)  # cached: the engine's own check is then free
        n, limit = len(prompt_token_ids), self.max_model_len
        if n + params.max_tokens > limit:  # refused, not capped, with vLLM's message
            raise InvalidParameter(
                "max_tokens",
                f"is too large: {params.max_tokens}. This model's maximum context length is {limit} tokens and "
                f"your request has {n} input tokens ({params.max_tokens} > {limit} - {n})",
            )

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Request:
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(ids, params)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, ids, params, self.eos_token_ids, self.tokenizer)
        # An EAGLE head that starts after a prefix-cache hit sees less context than without it,
        # and a seeded request's drafts, so its output, must not depend on what others cached.
        req.full_prefill = params.seed is not None and bool(self.speculator.feature_layers)
        if params.guided is not None:
            # EOS ends a structured output where its grammar accepts, even with ignore_eos.
            req.grammar = self.grammars.matcher(params.guided, self.eos_token_ids | set(params.stop_token_ids))
        self.scheduler.add(req)
        return req

    @property
    def grammars(self):
        """Compiled grammars of structured outputs (``engine.worker.grammar``) for this vocabulary."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidParameter("guided", "structured outputs need the model's tokenizer")
            from engine.worker.grammar import Grammars  # xgrammar loads only when a request needs it

            self._grammars = Grammars.from_tokenizer(self.tokenizer, self.model.config.vocab_size)
        return self._grammars

    @grammars.setter
    def grammars(self, value) -> None:
        self._grammars = value

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        out = self._delta(req)
        self._release()
        return out

    def fail_running(self, error: str) -> list[RequestOutput]:
        """End every running request with ``error`` (after a step that raised)."""
        running = list(self.scheduler.running)
        for req in running:
            self.scheduler.finish(req, "error", error)
        outs = [self._delta(r) for r in running]
        self._release()
        return outs

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_request(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    def snapshot(self) -> EngineSnapshot:
        sched = self.scheduler
        return EngineSnapshot(len(sched.running), len(sched.waiting), self.kv_manager.usage(), sched.num_preemptions)

    def _release(self) -> None:
        """The one release path: for every request that ended since the last call (finished,
        aborted or failed; its KV blocks freed by ``Scheduler.finish``), drop the runner's,
        the drafter's and the policy's state (``Speculator.free``). A preempted request keeps them (it resumes)."""
        for rid in self.scheduler.take_finished_ids():
            self.runner.free(rid)
            self.speculator.free(rid)

    def check_health(self) -> None:
        """Raises ``WorkerFailure`` once a tensor-parallel worker has died or hung."""
        if self.tp_workers is not None:
            self.tp_workers.check()

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any (the engine cannot step afterwards)."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()

    def step(self) -> list[RequestOutput]:
        clock = StepClock()
        plan = self.speculator.plan(self.scheduler.running)
        scheduled = self.scheduler.schedule(plan.num_draft_tokens, plan.isolated)
        if scheduled.is_empty:
            return []
        drafts = clock.lap(self.speculator.propose(scheduled, plan, self.scheduler.requests, self.kv_manager.block_table))
        result, failed = clock.lap(self._execute(scheduled, drafts))
        touched = failed + self.scheduler.update(scheduled, result)
        self._after_step(scheduled, plan, result, touched, clock.times(), drafts)
        return self._outputs(touched)

    def set_fault_hook(self, hook: FaultHook | None) -> None:
        """Tests: ``hook(stage, request_ids)`` may raise to simulate a failure (see engine.utils.faults)."""
        self.runner.fault_hook = self.speculator.fault_hook = hook

    def _grammar_masks(self, scheduled: SchedulerOutput, drafts: dict) -> dict:
        """The grammar bitmask rows of the structured requests that sample this step, for the
        runner: request id -> [k + 1, ceil(vocab / 32)] int32, row p after the first p drafts."""
        if self._grammars is None:  # no structured request was ever served
            return {}
        masks, vocab = {}, self.model.config.vocab_size
        for s in scheduled.scheduled:
            grammar = self.scheduler.requests[s.request_id].grammar
            if grammar is None or not s.sample:
                continue
            ids = drafts[s.request_id].token_ids if s.request_id in drafts else []
            masks[s.request_id] = grammar_bitmask([grammar] * (len(ids) + 1), [ids[:p] for p in range(len(ids) + 1)], vocab)
        return masks

    def _execute(self, scheduled: SchedulerOutput, drafts: dict) -> tuple[RunnerOutput, list[Request]]:
        """The target pass. If it fails, each request is retried alone, so that
        only the requests that fail by themselves end (with an error)."""
        masks = self._grammar_masks(scheduled, drafts)
        try:
            return self.runner.execute(scheduled, drafts, masks), []
        except Exception:  # isolated below
            log.exception("step of %d requests failed; retrying them one by one", len(scheduled.scheduled))
        merged, failed = RunnerOutput({}), []
        for s in scheduled.scheduled:
            alone = SchedulerOutput((s,), tuple(n for n in scheduled.new_requests if n.request_id == s.request_id))
            try:
                merged.merge(self.runner.execute(alone, drafts, masks))
            except Exception as e:  # noqa: BLE001 - this request alone fails
                log.error("request %s failed: %s", s.request_id, e)
                req = self.scheduler.requests[s.request_id]
                self.scheduler.finish(req, "error", f"internal error: {type(e).__name__}")
                failed.append(req)
        return merged, failed

    def _after_step(self, scheduled: SchedulerOutput, plan: StepPlan, result: RunnerOutput, touched, times,
                    drafts: dict) -> None:
        """Record the step's speculation (``Speculator.record``), report stats."""
        self.speculator.record(scheduled, plan, result, drafts, self.scheduler.requests, times.execute_s)
        if self.stat_loggers:
            try:  # metrics must never fail the step: its tokens are already committed
                spec = self.speculator.step_stats(result, self.scheduler.requests)
                stats = make_step_stats(scheduled, result, touched, times, spec)
                for logger in self.stat_loggers:
                    logger(stats)
            except Exception:
                log.exception("step stats failed; this step is missing from the metrics")

    def _outputs(self, touched: list[Request]) -> list[RequestOutput]:
        """The deltas of the requests a step touched, then the ended ones released."""
        outputs = [self._delta(r) for r in touched]
        self._release()
        return outputs

    def _delta(self, req: Request) -> RequestOutput:
        """The part of ``req``'s output not yet emitted."""
        tokens = req.token_ids[req.num_prompt_tokens + req.num_emitted_tokens :]
        end = len(req.output_text) - holdback(req)
        text = req.output_text[req.num_emitted_chars : end] if end > req.num_emitted_chars else ""
        logprobs = req.logprobs[req.num_emitted_tokens :] if req.logprobs is not None else None
        first = req.num_emitted_tokens == 0  # a request's first delta: its prompt is computed
        req.num_emitted_tokens += len(tokens)
        req.num_emitted_chars = max(req.num_emitted_chars, end)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            new_text=text,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs if first else None,
            error=req.error,
            spec=self.speculator.summary(req.request_id) if req.is_finished else {},
        )


def _log_ready(model, num_blocks: int, spec: KVSpec, device, dtype, attention: str) -> None:
    c_matmul = getattr(getattr(model, "lm_head", None), "kernel", None) is not None  # laid out by prepack
    log.info("engine ready: %d KV blocks of %d tokens on %s (%s, KV cache %s, attention %s); matmul %s%s",
             num_blocks, spec.block_size, device, dtype, spec.dtype, attention,
             "by the C kernel (batch invariant)" if c_matmul
             else f"by torch, inputs padded to {getattr(model, 'min_rows', 1)} rows",
             ", each decoder layer in one C call" if getattr(model, "fused", None) else "")


def eos_token_ids_of(hf_config, tokenizer, generation_config: dict | None = None) -> frozenset[int]:
    """The tokens that end a generation: the config's and the generation config's ``eos_token_id``
    (one or a list each; Llama 3's instruct models end turns with a second one) and the tokenizer's."""
    ids = set()
    for eos in (getattr(hf_config, "eos_token_id", None), (generation_config or {}).get("eos_token_id")):
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
