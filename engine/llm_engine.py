"""The synchronous engine: owns the model, the KV cache, the scheduler and the
runner, and advances every request by one step at a time.

Not thread-safe: one thread calls ``add_request``, ``abort_request`` and
``step`` (``AsyncEngine`` runs it on its own thread).
"""

import logging
import os
import time

import torch

from drafters.base import Draft, DraftSlot, build_drafter

from engine.config import EngineConfig
from engine.cost_tracker import CostTracker
from engine.faults import FaultHook
from engine.loader import load_config, load_model, load_tokenizer
from engine.model_store import resolve_model
from engine.models.llama import head_dim_of
from engine.outputs import RequestOutput
from engine.request import Request
from engine.runner import ModelRunner
from engine.sampling_params import InvalidParameter, SamplingParams
from engine.scheduler import RunnerOutput, Scheduler, SchedulerOutput, no_drafts
from engine.spec_policy import SpecPolicy, StepCosts
from engine.tree import is_chain, walk
from engine.stats import StepTimes, make_step_stats, measure_step_costs
from engine.stop import holdback
from kvcache import KVCacheManager, blocks_needed
from kvcache.tensors import KVSpec, PagedKV

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), model=None, tokenizer=None, drafter=None):
        """``model``, ``tokenizer`` and ``drafter`` may be given ready-made (tests);
        by default they are built from ``config``."""
        self.config = config
        device, dtype = config.model.torch_device(), config.model.torch_dtype()
        if device.type == "cpu":
            torch.set_num_threads(config.model.num_threads or os.cpu_count() or 1)
        if model is None:
            path = resolve_model(config.model.model)
            hf_config = load_config(path)
            max_len = config.model.max_model_len or hf_config.max_position_embeddings
            model = load_model(path, dtype, device, max_positions=max_len)
            tokenizer = tokenizer or load_tokenizer(path)
            self.model_path = str(path)
        else:
            self.model_path = "<in-memory>"
        self.model, self.tokenizer = model, tokenizer
        hf_config = model.config
        self.max_model_len = config.model.max_model_len or hf_config.max_position_embeddings
        spec = KVSpec(
            hf_config.num_hidden_layers, hf_config.num_key_value_heads, head_dim_of(hf_config), config.cache.block_size, dtype
        )
        num_blocks = config.cache.num_blocks or spec.num_blocks_for(config.cache.memory_bytes)
        if num_blocks < blocks_needed(self.max_model_len, spec.block_size):
            raise ValueError(
                f"the KV cache holds {num_blocks * spec.block_size} tokens, fewer than max_model_len="
                f"{self.max_model_len}; raise the KV-cache budget or lower max_model_len"
            )
        self.kv_manager = KVCacheManager(num_blocks, spec.block_size, config.cache.enable_prefix_caching)
        self.paged_kv = PagedKV(spec, num_blocks, device)
        self.runner = ModelRunner(model, self.paged_kv, spec.block_size, device, config.model.seed)
        self.cost_tracker: CostTracker | None = None  # set by _speculation when costs are timed
        self.drafter, self.policy = self._speculation(config, num_blocks, spec, device, dtype, drafter)
        slots = self.policy.num_draft_slots if self.policy else no_drafts
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.max_model_len, slots)
        self.eos_token_ids = _eos_ids(hf_config, tokenizer)
        self.stat_loggers: list = []  # callables taking each step's StepStats
        self.fault_hook: FaultHook | None = None
        self.step_fallbacks = 0  # 1 when the drafter failed in the current step
        self._grammars = None  # engine.grammar.Grammars, built at the first structured request
        log.info("engine ready: %d KV blocks of %d tokens on %s (%s); matmul inputs padded to %d rows",
                 num_blocks, spec.block_size, device, dtype, getattr(model, "min_rows", 1))

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
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidParameter(
                "max_tokens",
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds the model's maximum context length ({self.max_model_len})",
            )

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Request:
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(ids, params)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, ids, params, self.eos_token_ids, self.tokenizer)
        if params.guided is not None:
            # EOS ends a structured output where its grammar accepts, even with ignore_eos.
            req.grammar = self.grammars.matcher(params.guided, self.eos_token_ids | set(params.stop_token_ids))
        self.scheduler.add(req)
        return req

    @property
    def grammars(self):
        """Compiled grammars of structured outputs (``engine.grammar``) for this vocabulary."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidParameter("guided", "structured outputs need the model's tokenizer")
            from engine.grammar import Grammars  # xgrammar loads only when a request needs it

            self._grammars = Grammars.from_tokenizer(self.tokenizer, self.model.config.vocab_size)
        return self._grammars

    @grammars.setter
    def grammars(self, value) -> None:
        self._grammars = value

    def spec_summary(self, request_id: str) -> dict:
        """The request's speculation record (empty without speculation)."""
        st = self.policy.states.get(request_id) if self.policy else None
        return st.summary() if st else {}

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        return self._delta(req)

    def fail_requests(self, requests: list[Request], error: str) -> list[RequestOutput]:
        for req in requests:
            self.scheduler.finish(req, "error", error)
        return [self._delta(r) for r in requests]

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def _speculation(self, config: EngineConfig, num_blocks: int, spec: KVSpec, device, dtype, drafter=None):
        sc = config.speculative
        if sc.method is None and drafter is None:
            return None, None
        drafter = drafter or build_drafter(
            sc, target=self.model, tokenizer=self.tokenizer, num_blocks=num_blocks,
            block_size=spec.block_size, dtype=dtype, device=device, target_kv=self.paged_kv,
        )
        k = sc.num_speculative_tokens
        if sc.verify_cost is not None:
            costs = StepCosts.linear(sc.verify_cost)
        else:
            max_rows = min(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs + k)
            costs = measure_step_costs(self.model, self.runner, max_rows, spec.block_size, self.max_model_len)
            self.cost_tracker = CostTracker(costs)
        log.info("speculation: %s, k=%d, draft cost %.3f per token; pass cost by tokens %s",
                 sc.method, k, drafter.cost_per_token,
                 " ".join(f"{r}:{c:.2f}" for r, c in zip(costs.rows, costs.costs)))
        return drafter, SpecPolicy(sc, drafter.cost_per_token, costs, self._context_class)

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.step_fallbacks = 0
        if self.policy is not None:
            self.policy.begin_step(len(self.scheduler.running))
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        drafts = self._propose(scheduled)
        t1 = time.perf_counter()
        result, failed = self._execute(scheduled, drafts)
        t2 = time.perf_counter()
        touched = failed + self.scheduler.update(scheduled, result)
        self._after_step(scheduled, result, touched, StepTimes(t1 - t0, t2 - t1, time.perf_counter() - t0), drafts)
        return [self._delta(r) for r in touched]

    def set_fault_hook(self, hook: FaultHook | None) -> None:
        """Tests: ``hook(stage, request_ids)`` may raise to simulate a failure (see engine.faults)."""
        self.fault_hook = self.runner.fault_hook = hook

    def _propose(self, scheduled: SchedulerOutput) -> dict:
        """Drafts for the scheduled slots; a failing drafter means no drafts this step."""
        if self.drafter is None:
            return {}
        for rid in scheduled.finished_ids:
            self.drafter.free(rid)
        slots = [
            DraftSlot(s.request, s.num_draft_slots, s.block_table, self.policy.template(s.request_id))
            for s in scheduled.scheduled
            if s.num_draft_slots
        ]
        if not slots:
            return {}
        try:
            if self.fault_hook:
                self.fault_hook("drafter", [s.request.request_id for s in slots])
            return _cut_to_grammar(self.drafter.propose(slots), slots)
        except Exception:  # noqa: BLE001 - speculation is an optimization: decode plainly instead
            log.exception("drafter failed; %d requests decode without drafts this step", len(slots))
            self.step_fallbacks = 1
            for s in slots:
                self.drafter.free(s.request.request_id)  # its caches may be half-written
            return {}

    def _context_class(self, request: Request) -> int | None:
        """The drafter's class of the request's context (scheduling asks it); a failure
        means no drafts for this request this step, as in ``_propose``."""
        try:
            if self.fault_hook:
                self.fault_hook("drafter", [request.request_id])
            return self.drafter.context_class(request)
        except Exception:  # noqa: BLE001 - speculation is an optimization: decode plainly instead
            log.exception("drafter failed; request %s decodes without drafts this step", request.request_id)
            self.step_fallbacks = 1
            self.drafter.free(request.request_id)
            return None

    def _execute(self, scheduled: SchedulerOutput, drafts: dict) -> tuple[RunnerOutput, list[Request]]:
        """The target pass. If it fails, each request is retried alone, so that
        only the requests that fail by themselves end (with an error)."""
        try:
            return self.runner.execute(scheduled, drafts), []
        except Exception:  # noqa: BLE001 - isolated below
            log.exception("step of %d requests failed; retrying them one by one", len(scheduled.scheduled))
        merged, failed = RunnerOutput({}), []
        for i, s in enumerate(scheduled.scheduled):
            alone = SchedulerOutput((s,), finished_ids=scheduled.finished_ids if i == 0 else ())
            try:
                merged.merge(self.runner.execute(alone, drafts))
            except Exception as e:  # noqa: BLE001 - this request alone fails
                log.error("request %s failed: %s", s.request_id, e)
                self.scheduler.finish(s.request, "error", f"internal error: {type(e).__name__}")
                failed.append(s.request)
        return merged, failed

    def _after_step(self, scheduled: SchedulerOutput, result: RunnerOutput, touched: list[Request], times,
                    drafts: dict) -> None:
        """Tell the drafter what was kept, feed the policy, report stats."""
        if self.policy is not None:
            for s in scheduled.scheduled:
                rid, draft = s.request_id, drafts.get(s.request_id)
                accepted = result.num_accepted.get(rid, 0)
                outcomes = None
                if draft is not None and not is_chain(draft.parents) and rid in result.sampled:
                    outcomes = walk(draft.token_ids, draft.parents, result.sampled[rid][:accepted])
                self.policy.record(s.request, result.num_drafted.get(rid, 0), accepted, outcomes)
                if not s.request.is_finished:
                    self.drafter.commit(s.request)
            self.policy.end_step()
            if self.cost_tracker is not None and all(len(s.token_ids) == 1 for s in scheduled.scheduled):
                rows = scheduled.num_tokens + sum(result.num_drafted.values())  # decode step: last tokens + drafts
                self.policy.step_costs = self.cost_tracker.observe(rows, times.execute_s)
        if self.stat_loggers:
            try:  # metrics must never fail the step: its tokens are already committed
                stats = make_step_stats(self, scheduled, result, touched, times)
                for logger in self.stat_loggers:
                    logger(stats)
            except Exception:  # noqa: BLE001
                log.exception("step stats failed; this step is missing from the metrics")

    def _delta(self, req: Request) -> RequestOutput:
        """The part of ``req``'s output not yet emitted."""
        tokens = req.output_token_ids[req.num_emitted_tokens :]
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
            spec=self._finish_spec(req) if req.is_finished else {},
        )

    def _finish_spec(self, req: Request) -> dict:
        if self.policy is None:
            return {}
        summary = self.spec_summary(req.request_id)
        self.policy.free(req.request_id)
        self.drafter.free(req.request_id)
        return summary


def _cut_to_grammar(drafts: dict, slots: list[DraftSlot]) -> dict:
    """Each draft chain of a request with a grammar, cut at its first token outside the
    grammar (before the target pass; exact, see ``engine.grammar``)."""
    for s in slots:
        rid, grammar = s.request.request_id, s.request.grammar
        if grammar is None or rid not in drafts:
            continue
        d = drafts[rid]
        n = grammar.valid_draft_prefix(d.token_ids)
        if n == 0:
            del drafts[rid]
        elif n < len(d.token_ids):
            drafts[rid] = Draft(d.token_ids[:n], None if d.probs is None else d.probs[:n])
    return drafts


def _eos_ids(hf_config, tokenizer) -> frozenset[int]:
    ids = set()
    eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
