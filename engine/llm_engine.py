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
import time

import torch

from engine.attention import select_backend
from engine.attention.backends import flash_attn_status
from engine.config import EngineConfig
from engine.cuda_graphs import BucketedForward, bucket_limits, graph_pool_bytes, graphs_apply
from engine.devices import choose_device
from engine.distributed import TensorParallelModel, load_target
from engine.faults import FaultHook
from engine.gpu_memory import DrafterMemory, num_kv_blocks
from engine.loader import SAMPLING_DEFAULTS, load_config, load_generation_config, load_tokenizer
from engine.model_store import resolve_model
from engine.models.decoder import head_dim_of
from engine.outputs import RequestOutput
from engine.request import Request
from engine.runner import ModelRunner
from engine.sampler import grammar_bitmask
from engine.sampling_params import InvalidParameter, SamplingParams
from engine.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from engine.spec_decode.cost_tracker import CostTracker, measure_step_costs
from engine.spec_decode.drafter import Draft, DraftSlot
from engine.spec_decode.fixed_policy import FixedPolicy
from engine.spec_decode.policy import Candidate, SpecPolicy, SpecState, StepCosts, StepPlan
from engine.spec_decode.registry import build_drafter, check_speculative, drafter_memory
from engine.stats import EngineSnapshot, StepTimes, make_step_stats
from engine.tree import is_chain, walk
from engine.stop import holdback
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
        if model is None:
            path = resolve_model(config.model.model, config.model.quantization)
            hf_config = load_config(path)
            max_len = config.model.max_model_len or hf_config.max_position_embeddings
            model = load_target(path, config, dtype, device, max_len)  # rank 0's shard at tensor_parallel_size > 1
            tokenizer = tokenizer or load_tokenizer(path)
            self.model_path = str(path)
            generation = load_generation_config(path)
        else:
            self.model_path, generation = "<in-memory>", {}
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
        num_blocks = num_kv_blocks(config, spec, model, attention, device, self.max_model_len,  # GPU: engine.gpu_memory
                                   needs or DrafterMemory(), graph_bytes)
        if num_blocks < blocks_needed(self.max_model_len, spec.block_size):
            raise ValueError(
                f"the KV cache holds {num_blocks * spec.block_size} tokens, fewer than max_model_len="
                f"{self.max_model_len}; raise the KV-cache budget or lower max_model_len"
            )
        self.kv_manager = KVCacheManager(num_blocks, spec.block_size, config.cache.enable_prefix_caching)
        self.paged_kv = PagedKV(spec, num_blocks, device, pad_block=graphs)
        self.runner = ModelRunner(model, self.paged_kv, spec.block_size, device, config.model.seed, attention)
        self.cost_tracker: CostTracker | None = None  # set by _speculation when costs are timed
        self.drafter, self.policy = self._speculation(config, num_blocks, spec, device, dtype, drafter)
        self.runner.feature_layers = self.drafter.feature_layers if self.drafter else ()
        if graphs and not self.runner.feature_layers:  # a drafter reading features runs every step eagerly
            self.runner.bucketed = BucketedForward(model, attention.name, self.paged_kv, self.max_model_len, device,
                                                   *bucket_limits(config), graphs=True)
            self.runner.bucketed.capture_all()
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.max_model_len)
        self.eos_token_ids = eos_token_ids_of(hf_config, tokenizer, generation)
        self.stat_loggers: list = []  # callables taking each step's StepStats
        self.fault_hook: FaultHook | None = None
        self.step_fallbacks = 0  # 1 when the drafter failed in the current step
        self._grammars = None  # engine.grammar.Grammars, built at the first structured request
        c_matmul = getattr(getattr(model, "lm_head", None), "kernel", None) is not None  # laid out by prepack
        log.info("engine ready: %d KV blocks of %d tokens on %s (%s, KV cache %s, attention %s); matmul %s%s",
                 num_blocks, spec.block_size, device, dtype, kv_dtype, attention.name,
                 "by the C kernel (batch invariant)" if c_matmul
                 else f"by torch, inputs padded to {getattr(model, 'min_rows', 1)} rows",
                 ", each decoder layer in one C call" if getattr(model, "fused", None) else "")

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
        req.full_prefill = params.seed is not None and bool(self.drafter is not None and self.drafter.feature_layers)
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
        """The request's speculation record: zero counts for a request that drew no drafts (opted
        out, finished at its prefill), so that every reply of a speculating engine carries one;
        empty without speculation."""
        if self.policy is None:
            return {}
        st = self.policy.states.get(request_id)
        return (st or SpecState()).summary()

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
        the drafter's and the policy's state. A preempted request keeps them (it resumes)."""
        for rid in self.scheduler.take_finished_ids():
            self.runner.free(rid)
            if self.drafter is not None:
                self.drafter.free(rid)
            if self.policy is not None:
                self.policy.free(rid)

    def check_health(self) -> None:
        """Raises ``WorkerFailure`` once a tensor-parallel worker has died or hung."""
        if self.tp_workers is not None:
            self.tp_workers.check()

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any (the engine cannot step afterwards)."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()

    def _speculation(self, config: EngineConfig, num_blocks: int, spec: KVSpec, device, dtype, drafter=None):
        sc = config.speculative
        if sc.method is None and drafter is None:
            return None, None
        drafter = drafter or build_drafter(
            sc, target=self.model, tokenizer=self.tokenizer, num_blocks=num_blocks,
            block_size=spec.block_size, dtype=dtype, kv_dtype=spec.dtype, device=device, target_kv=self.paged_kv,
            attention=self.runner.attention, target_path=self.model_path,
        )
        if not sc.adaptive:  # the same round every step: nothing to price, nothing to measure
            log.info("speculation: %s, %d drafts%s every step", sc.method, sc.num_speculative_tokens,
                     " or the configured tree" if sc.uses_trees else "")
            return drafter, FixedPolicy(sc)
        if sc.verify_cost is not None:
            costs = StepCosts.linear(sc.verify_cost)
        else:
            most = config.scheduler.max_num_seqs + sc.num_speculative_tokens
            max_rows = min(config.scheduler.max_num_batched_tokens, most)
            costs = measure_step_costs(self.model, self.runner, max_rows, spec.block_size, self.max_model_len)
            self.cost_tracker = CostTracker(costs)
        log.info("speculation: %s, num_speculative_tokens=%d, draft cost %.3f per token; pass cost by tokens %s",
                 sc.method, sc.num_speculative_tokens, drafter.cost_per_token,
                 " ".join(f"{r}:{c:.2f}" for r, c in zip(costs.rows, costs.costs)))
        return drafter, SpecPolicy(sc, drafter.cost_per_token, costs)

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.step_fallbacks = 0
        plan = self._plan()
        scheduled = self.scheduler.schedule(plan.num_draft_tokens, plan.isolated)
        if scheduled.is_empty:
            return []
        drafts = self._propose(scheduled, plan)
        t1 = time.perf_counter()
        result, failed = self._execute(scheduled, drafts, self._grammar_masks(scheduled, drafts))
        t2 = time.perf_counter()
        touched = failed + self.scheduler.update(scheduled, result)
        self._after_step(scheduled, plan, result, touched, StepTimes(t1 - t0, t2 - t1, time.perf_counter() - t0), drafts)
        outputs = [self._delta(r) for r in touched]
        self._release()
        return outputs

    def set_fault_hook(self, hook: FaultHook | None) -> None:
        """Tests: ``hook(stage, request_ids)`` may raise to simulate a failure (see engine.faults)."""
        self.fault_hook = self.runner.fault_hook = hook

    def _plan(self) -> StepPlan:
        """The speculation policy's plan for this step, from the records of the steps before
        it and the drafter's context classes of the decoding requests (asked here, before
        scheduling). Changes no policy state. A request drafts once it has an output token:
        whether the step that computes its last prompt token could draft would depend on
        where the budget and the prefix cache cut its prompt, not on the request alone."""
        if self.policy is None:
            return StepPlan({})
        running = self.scheduler.running
        shared = self.policy.plans_shared(len(running))  # False: only seeded requests are planned
        candidates = [
            Candidate(r.request_id, self._context_class(r), isolated=r.params.seed is not None, trees=r.grammar is None)
            for r in running
            if r.params.speculate and r.num_output_tokens and r.num_computed_tokens + 1 == r.num_tokens
            and (shared or r.params.seed is not None)
        ]
        return self.policy.plan(candidates, len(running))

    def _propose(self, scheduled: SchedulerOutput, plan: StepPlan) -> dict:
        """Drafts for the scheduled slots (a chain, or a tree of the plan's shape). When the
        drafter fails, each request is rolled back and drafted alone, so that only the
        requests that fail by themselves decode without drafts this step (their drafter
        state dropped); the others keep their state and their drafts."""
        if self.drafter is None:
            return {}
        requests, tables, decisions = self.scheduler.requests, self.kv_manager.block_table, plan.decisions
        slots = [
            DraftSlot(requests[s.request_id], s.num_draft_tokens, tuple(tables(s.request_id)),
                      decisions[s.request_id].template)
            for s in scheduled.scheduled
            if s.num_draft_tokens
        ]
        if not slots:
            return {}
        try:
            return self._drafts(slots)
        except Exception:  # isolated below
            log.exception("drafter failed for %d requests; drafting them one by one", len(slots))
        self.step_fallbacks = 1
        drafts = {}
        for s in slots:
            self.drafter.rollback(s.request)
            try:
                drafts.update(self._drafts([s]))
            except Exception:  # speculation is an optimization: decode plainly instead
                log.exception("drafter failed; request %s decodes without drafts this step", s.request.request_id)
                self.drafter.free(s.request.request_id)  # its caches may be half-written
        return drafts

    def _drafts(self, slots: list[DraftSlot]) -> dict:
        if self.fault_hook:
            self.fault_hook("drafter", [s.request.request_id for s in slots])
        return _cut_to_grammar(self.drafter.propose(slots), slots)

    def _context_class(self, request: Request) -> int | None:
        """The drafter's class of the request's context (the plan asks it); a failure
        means no drafts for this request this step, as in ``_propose``."""
        try:
            if self.fault_hook:
                self.fault_hook("drafter", [request.request_id])
            return self.drafter.context_class(request)
        except Exception:  # speculation is an optimization: decode plainly instead
            log.exception("drafter failed; request %s decodes without drafts this step", request.request_id)
            self.step_fallbacks = 1
            self.drafter.free(request.request_id)
            return None

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

    def _execute(self, scheduled: SchedulerOutput, drafts: dict, masks: dict) -> tuple[RunnerOutput, list[Request]]:
        """The target pass. If it fails, each request is retried alone, so that
        only the requests that fail by themselves end (with an error)."""
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
        """Tell the drafter what was kept, record the plan of the requests that ran, report stats."""
        if self.policy is not None:
            if result.features:
                self.drafter.add_features(result.features)
            for s in scheduled.scheduled:
                rid, draft = s.request_id, drafts.get(s.request_id)
                accepted = result.num_accepted.get(rid, 0)
                if rid in plan.decisions:
                    outcomes = None
                    if draft is not None and not is_chain(draft.parents) and rid in result.sampled:
                        outcomes = walk(draft.token_ids, draft.parents, result.sampled[rid][:accepted])
                    self.policy.record(rid, plan.decisions[rid], result.num_draft_tokens.get(rid, 0), accepted, outcomes)
                if (req := self.scheduler.requests.get(rid)) is not None:  # not finished
                    self.drafter.commit(req)
            self.policy.end_step(plan)
            if self.cost_tracker is not None and all(len(s.token_ids) == 1 for s in scheduled.scheduled):
                rows = scheduled.num_tokens + sum(result.num_draft_tokens.values())  # decode step: last tokens + drafts
                self.policy.step_costs = self.cost_tracker.observe(rows, times.execute_s, result.verify_s)
        if self.stat_loggers:
            try:  # metrics must never fail the step: its tokens are already committed
                stats = make_step_stats(self, scheduled, result, touched, times)
                for logger in self.stat_loggers:
                    logger(stats)
            except Exception:
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
            spec=self.spec_summary(req.request_id) if req.is_finished else {},
        )


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


def eos_token_ids_of(hf_config, tokenizer, generation_config: dict | None = None) -> frozenset[int]:
    """The tokens that end a generation: the config's and the generation config's ``eos_token_id``
    (one or a list each; Llama 3's instruct models end turns with a second one) and the tokenizer's."""
    ids = set()
    for eos in (getattr(hf_config, "eos_token_id", None), (generation_config or {}).get("eos_token_id")):
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
