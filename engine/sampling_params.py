"""Per-request sampling settings, validated once at construction."""

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_TOP_K = 1 << 20  # more than any vocabulary; larger values are refused, not clamped
GREEDY_EPS = 1e-5  # temperatures below this are greedy


@dataclass(frozen=True)
class GuidedDecoding:
    """A grammar the output must follow (compiled by ``engine.worker.grammar.Grammars``).

    ``kind`` "json": ``value`` is a JSON schema (as JSON text); "json_object": any JSON
    object (``value`` unused); "regex": a regular expression; "choice": a JSON list of
    strings, the output being exactly one of them; "grammar": a context-free grammar,
    xgrammar's EBNF (``root ::= ...``) or Lark (``start: ...``). ``param`` names the request field
    it came from, for error messages.
    """

    kind: str
    value: str = ""
    param: str = field(default="guided", compare=False)

    def __post_init__(self):
        _check(self.kind in GUIDED_KINDS, self.param, f"kind must be one of {GUIDED_KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Processing order of the logits (the "processed distribution" p):
    repetition / presence / frequency penalties, logit_bias, temperature,
    top-k, top-p, min-p. Temperature 0 is greedy: the argmax after penalties
    and bias.
    """

    max_tokens: int = 16  # 0: prefill only (prompt logprobs), no token sampled, finish_reason "length"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N logprobs per output token (0 = only the sampled token's)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (0 = only the token's); see scores_prompt
    skip_special_tokens: bool = True
    speculate: bool = True  # per-request opt-out of speculative decoding
    guided: GuidedDecoding | None = None  # structured output: the grammar the output follows

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            _check(math.isfinite(getattr(self, name)), name, f"must be a finite number, got {getattr(self, name)}")
        _check(self.top_k <= MAX_TOP_K, "top_k", f"must be at most {MAX_TOP_K}, got {self.top_k}")
        _check(
            self.seed is None or 0 <= self.seed < 2**63, "seed", f"must be in [0, 2^63), got {self.seed}"
        )
        _check(self.max_tokens >= 0, "max_tokens", f"must be at least 0, got {self.max_tokens}")
        _check(self.temperature >= 0, "temperature", f"must be non-negative, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1 (disabled) or at least 1, got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        _check(
            -2 <= self.frequency_penalty <= 2, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}"
        )
        _check(
            0 < self.repetition_penalty <= 100,
            "repetition_penalty",
            f"must be in (0, 100], got {self.repetition_penalty}",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs",
            f"must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}",
        )
        for tok, bias in (self.logit_bias or {}).items():
            _check(isinstance(tok, int) and tok >= 0, "logit_bias", f"keys must be token ids, got {tok!r}")
            _check(
                math.isfinite(bias) and -100 <= bias <= 100, "logit_bias", f"values must be in [-100, 100], got {bias}"
            )
        _check(all(s for s in self.stop), "stop", "must not hold an empty string")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def scores_prompt(self) -> bool:
        """The request wants the log-probability of every prompt token, computed by
        its own prefill: every prompt position must go through the model for it, so
        a prefix cache must not skip any of its prompt tokens (it may still share
        the blocks this prefill computes)."""
        return self.prompt_logprobs is not None

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


class InvalidParameter(ValueError):
    """A request parameter out of range; ``param`` names it (OpenAI's error ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param} {message}")
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(param, message)
