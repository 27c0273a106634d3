"""A request's state as the scheduler tracks it. No torch."""

import enum
import time

from engine.core.detokenizer import IncrementalDetokenizer
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Token ids (prompt then output), how many of them are in the KV cache,
    and the output text produced so far.

    Invariant: ``num_computed_tokens <= num_tokens``; the scheduler makes every
    running request catch ``num_computed_tokens`` up to ``num_tokens``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        tokenizer=None,
    ):
        self.request_id = request_id
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens) if tokenizer else None
        self.output_text = ""
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # Entry i scores prompt token i + 1; filled chunk by chunk by the prefill (scores_prompt).
        self.prompt_logprobs: list[TokenLogprob] | None = [] if params.scores_prompt else None
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        # Computes every token of its prompt, taking no prefix-cache hit (set by the engine: a
        # seeded request whose drafter reads the target's features of every position).
        self.full_prefill = False
        # The structured-output matcher (engine.worker.grammar.RequestGrammar), set by the engine
        # when params.guided is; it follows the committed tokens only.
        self.grammar = None
        # Delta bookkeeping: what the last emitted RequestOutput covered.
        self.num_emitted_tokens = 0
        self.num_emitted_chars = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def add_prompt_logprobs(self, start: int, entries: list[TokenLogprob]) -> None:
        """Entries ``start``, ``start + 1``, ... of ``prompt_logprobs`` from one prefill
        chunk; those already held (a prompt recomputed after preemption) are kept."""
        have = len(self.prompt_logprobs)
        if start <= have:
            self.prompt_logprobs.extend(entries[have - start :])

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
