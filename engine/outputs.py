"""What the engine hands back: per-step deltas of each request's output."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first
    rank: int | None = None  # of token_id in the vocabulary, 1 = most likely (prompt logprobs only)


@dataclass
class RequestOutput:
    """The new part of one request's output since the previous delta."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    logprobs: list[TokenLogprob] | None = None
    # Prompt tokens 1.. (the first has none), on the request's first delta only.
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # set when finish_reason == "error"
    spec: dict = field(default_factory=dict)  # speculation summary, on the last delta


@dataclass
class CompletionOutput:
    """A finished request, as the offline API returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (the first has none)
