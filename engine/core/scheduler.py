"""The scheduler: which requests run this step and how many tokens each computes.

One rule: every running request catches ``num_computed_tokens`` up to
``num_tokens``. A new prompt, a chunk of a long prompt, a request resumed after
preemption and a decode are the same thing with different counts. It speaks
ids and counts only (no torch) and hands the runner one frozen
``SchedulerOutput`` per step: plain data (it pickles), never a live ``Request``.
A request crosses once, whole, the first time it is scheduled
(``NewRequest``); after that each step sends only what changed
(``ScheduledRequest``): the tokens to compute, the block ids appended to its
table (after a preemption, from the first block that changed), and its
number of draft tokens. The runner keeps the rest keyed by request id.

Order: running requests first, oldest first, then waiting ones while the token
budget, ``max_num_seqs`` and free blocks allow. When a running request cannot
get blocks, the newest running request is preempted: its blocks are freed, its
computed count drops to zero, and it goes back to the front of the waiting
queue, to be recomputed from its tokens (prompt and output so far).

Prefix caching is one more count: at admission a request (new, or resumed
after preemption) starts with ``num_computed_tokens`` = the tokens of its
longest cached prefix of full blocks, whose blocks it shares
(``KVCacheManager.find_cached_prefix``), and computes only the rest. After
each step the full blocks of its verified tokens are registered for others.
"""

import time
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.core.stop import append_tokens
from kvcache import KVCacheManager


@dataclass(frozen=True)
class NewRequest:
    """A request the runner has not seen yet: sent once, in the step that first schedules it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's work this step, as changes to what the runner already holds."""

    request_id: str
    token_ids: tuple[int, ...]  # tokens computed this step: positions context_len ..
    context_len: int  # tokens already in the KV cache
    # The block table is ``runner's table[:block_start] + new_block_ids``: blocks appended
    # this step, or (after a preemption) from the first block that changed.
    block_start: int
    new_block_ids: tuple[int, ...]
    sample: bool  # the last token's logits give the next token (False mid-prompt and for max_tokens 0)
    num_draft_tokens: int = 0  # drafts that may follow token_ids (KV slots reserved for them)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    new_requests: tuple[NewRequest, ...] = ()  # first scheduled this step: the runner keeps them
    preempted_ids: tuple[str, ...] = ()
    # Prefix cache, for metrics: tokens of the requests admitted this step, and how many were cached.
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    sampled: dict[str, list[int]]  # request id -> new tokens: accepted drafts + recovered / bonus token
    logprobs: dict[str, list] = field(default_factory=dict)
    # request id -> (index of its first entry in Request.prompt_logprobs, entries), per prefill chunk
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)
    num_draft_tokens: dict[str, int] = field(default_factory=dict)  # drafts verified, per request that had any
    num_accepted: dict[str, int] = field(default_factory=dict)
    # request id -> (first position, features [n, F]) of the kept tokens, for a drafter that reads them
    features: dict[str, tuple] = field(default_factory=dict)
    # request id -> the accepted branch's node indices, for a token tree whose first node was accepted
    accepted_nodes: dict[str, list[int]] = field(default_factory=dict)
    verify_s: float = 0.0  # seconds in the verification rule (0: no drafts): the policy's fixed cost

    def merge(self, other: "RunnerOutput") -> None:
        self.verify_s += other.verify_s
        for mine, theirs in ((self.sampled, other.sampled), (self.logprobs, other.logprobs),
                             (self.prompt_logprobs, other.prompt_logprobs),
                             (self.num_draft_tokens, other.num_draft_tokens), (self.num_accepted, other.num_accepted),
                             (self.features, other.features), (self.accepted_nodes, other.accepted_nodes)):
            mine.update(theirs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._num_synced_blocks: dict[str, int] = {}  # leading blocks of a table the runner holds; absent: new
        self.num_preemptions = 0
        self.watermark = max(1, kv.pool.num_blocks // 100)  # blocks kept free when admitting

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, reason: str, error: str | None = None) -> None:
        """End a request wherever it is and free its blocks."""
        if request.request_id not in self.requests:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request, reason, error)

    def _release(self, request: Request, reason: str, error: str | None = None) -> None:
        """``finish`` but for the queues: the caller takes ``request`` out of ``running`` or ``waiting``."""
        if not request.is_finished:
            request.finish(reason, error)
        del self.requests[request.request_id]
        self._num_synced_blocks.pop(request.request_id, None)
        self.kv.free(request.request_id)
        self._finished_ids.append(request.request_id)

    def take_finished_ids(self) -> list[str]:
        """The requests ended (finished, aborted, failed) since the last call: the engine's
        release path frees what the rest of the engine holds for them."""
        ids, self._finished_ids = self._finished_ids, []
        return ids

    def schedule(self, num_draft_tokens: Mapping[str, int] | None = None,
                 isolated: Collection[str] = ()) -> SchedulerOutput:
        """This step's work. ``num_draft_tokens``: the speculation policy's plan, request
        id -> draft slots wanted after its decode token (cut to the budget and limits);
        ``isolated``: requests whose slots the budget never cuts (seeded ones: their output
        depends on their number of drafts). Their decode token and slots are set aside
        from the budget first; one that does not fit what is left waits for a later step."""
        scheduled: list[ScheduledRequest] = []
        new: list[NewRequest] = []
        preempted: list[str] = []
        budget = self._schedule_running(num_draft_tokens or {}, isolated, scheduled, new, preempted)
        queries = hits = 0
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = self._admit(req, budget)
            if n is None:
                break
            if self.kv.enable_prefix_caching:
                queries, hits = queries + req.num_tokens, hits + req.num_computed_tokens
            scheduled.append(self._scheduled(req, n, new))
            budget -= n
        return SchedulerOutput(tuple(scheduled), tuple(new), tuple(preempted), queries, hits)

    def _schedule_running(self, num_draft_tokens: Mapping[str, int], isolated: Collection[str], scheduled, new,
                          preempted) -> int:
        """The running requests' work, oldest first; returns the budget left."""
        budget = self.config.max_num_batched_tokens
        uncut = {rid: self._num_draft_tokens(self.requests[rid], 1, budget, num_draft_tokens[rid])
                 for rid in isolated if rid in num_draft_tokens}
        set_aside = sum(1 + d for d in uncut.values())
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            i += 1
            drafts = uncut.get(req.request_id)
            if drafts is not None:
                n, set_aside = 1, set_aside - 1 - drafts
                if 1 + drafts > budget:
                    continue
            else:
                n = min(self._num_to_compute(req), budget - set_aside)
                if n <= 0:
                    continue
                drafts = self._num_draft_tokens(req, n, budget - set_aside, num_draft_tokens.get(req.request_id, 0))
            if not self._reserve(req, n + drafts, preempted):
                break
            scheduled.append(self._scheduled(req, n, new, drafts))
            budget -= n + drafts
        return budget

    @staticmethod
    def _num_to_compute(req: Request) -> int:
        """Tokens left to compute before ``req`` samples. A request recomputing after a
        preemption (its output begun, more than one token behind) stops one token short,
        over however many steps, as at admission: its last token then decodes with the
        drafts it would have had unpreempted, so a seeded request draws the same numbers."""
        left = req.num_tokens - req.num_computed_tokens
        return left - 1 if left > 1 and req.num_output_tokens > 0 else left

    def _admit(self, req: Request, budget: int) -> int | None:
        """Move the first waiting request (new or preempted: nothing computed, no
        blocks) to running, computed up to its cached prefix. Returns how many
        tokens it computes this step; None, changing nothing, when blocks are short."""
        # A request that scores its prompt computes every prompt token (its blocks may still be
        # shared); one whose output has begun (resumed after preemption) recomputes up to its
        # last token only, which then decodes with the drafts it would have had unpreempted.
        resumed = req.num_output_tokens > 0
        full = req.params.scores_prompt or req.full_prefill
        cached = [] if full else self.kv.find_cached_prefix(req.request_id, req.token_ids[: req.num_tokens - resumed])
        start = len(cached) * self.kv.block_size
        n = min(req.num_tokens - resumed - start, budget)
        need = self.kv.num_new_blocks(req.request_id, start + n, cached)
        if need > self.kv.num_free_blocks - self.watermark and self.running:
            return None
        if not self.kv.allocate_slots(req.request_id, start + n, cached):
            return None
        self.waiting.popleft()
        req.num_computed_tokens = start
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return n

    def _num_draft_tokens(self, req: Request, n: int, budget: int, wanted: int) -> int:
        """Draft slots after a decode token, within the budget and the request's limits."""
        if not wanted or n != 1 or req.num_computed_tokens + 1 != req.num_tokens:
            return 0  # prefill or a partial chunk: nothing to draft after
        room = min(
            budget - 1,
            req.params.max_tokens - req.num_output_tokens - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        return max(0, min(wanted, room))

    def _reserve(self, req: Request, n: int, preempted: list[str]) -> bool:
        """Blocks for ``n`` more tokens of ``req``, preempting the newest running
        requests as needed. False when ``req`` itself had to be preempted."""
        while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        self._num_synced_blocks[req.request_id] = 0
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _scheduled(self, req: Request, n: int, new: list[NewRequest], num_draft_tokens: int = 0) -> ScheduledRequest:
        rid, start = req.request_id, req.num_computed_tokens
        synced = self._num_synced_blocks.get(rid)
        if synced is None:
            new.append(NewRequest(rid, tuple(req.prompt_token_ids), req.params))
            synced = 0
        table = self.kv.block_table(rid)
        self._num_synced_blocks[rid] = len(table)
        return ScheduledRequest(
            request_id=rid,
            token_ids=tuple(req.token_ids[start : start + n]),
            context_len=start,
            block_start=synced,
            new_block_ids=tuple(table[synced:]),
            sample=start + n == req.num_tokens and req.params.max_tokens > 0,
            num_draft_tokens=num_draft_tokens,
        )

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, apply stops.

        Rollback is "do not commit": the KV entries of accepted drafts are kept
        (they were computed on the right prefix); those of rejected drafts are
        simply not counted, and the next step overwrites them. Their blocks stay in
        the request's table for its next drafts (freeing them would put them at the
        back of the free queue and take the next ones from its front, evicting a
        cached prefix every step). Full blocks of verified tokens (below the new
        ``num_computed_tokens``, accepted drafts now being committed tokens) enter
        the prefix cache. Returns the requests that got new tokens (finished ones
        included, their blocks released).
        """
        touched, finished = [], []
        for s in out.scheduled:
            rid = s.request_id
            req = self.requests.get(rid)
            if req is None:
                continue  # aborted or failed during the step
            req.num_computed_tokens += len(s.token_ids) + result.num_accepted.get(rid, 0)
            if rid in result.prompt_logprobs:
                req.add_prompt_logprobs(*result.prompt_logprobs[rid])
            tokens = result.sampled.get(rid)
            if tokens:
                if req.first_token_time is None:
                    req.first_token_time = time.monotonic()
                append_tokens(req, tokens, self.max_model_len, result.logprobs.get(rid))
                touched.append(req)
            # A stop inside the accepted drafts leaves computed entries past the last kept token.
            self.kv.cache_blocks(rid, req.token_ids, min(req.num_computed_tokens, req.num_tokens))
            if not tokens and req.params.max_tokens == 0 and req.num_computed_tokens == req.num_tokens:
                req.finish("length")  # prefill only: nothing to sample
                touched.append(req)
            if req.is_finished:
                self._release(req, req.finish_reason)
                finished.append(req)
        if finished:  # scheduled, so running: removed in one pass, not one list search each
            gone = set(map(id, finished))
            self.running[:] = [r for r in self.running if id(r) not in gone]
        return touched
