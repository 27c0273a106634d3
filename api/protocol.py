"""OpenAI protocol: request and response bodies of /v1/completions, /v1/chat/completions
and /v1/models, as pydantic models.

Request models check types only; value ranges are checked once, by the engine's
``SamplingParams`` (whose ``InvalidParameter`` names the field), so the rules
live in one place. Optional sampling fields accept ``null`` and fall back to
OpenAI's defaults. Unknown fields are ignored (as vLLM does); fields we know but
do not implement are refused with a 400 by the serving layer.

Response models have exactly OpenAI's fields: ``None`` is sent as ``null``
except in a chat stream ``delta``, whose unset fields are left out.
"""

import time
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_serializer, model_validator
from pydantic_core import PydanticCustomError

# ---- requests ----

# Integers the engine turns into int64 tensors or torch seeds: larger ones would
# fail inside an engine step (taking the whole batch down), so they stop here.
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]  # lt: 2^63 is exact as a JSON float, 2^63 - 1 is not


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a token id must be an integer, not a boolean")
    return value


# A prompt token id: an integer (JSON's 3.0 is one; true is not).
TokenId = Annotated[int, BeforeValidator(_not_bool), Field(ge=-(2**63), lt=2**63)]


def lone_surrogate_at(data: Any) -> str | None:
    """The path ("messages.0.content") of the first string in ``data`` holding a lone
    UTF-16 surrogate (JSON can escape one, "\\ud800"; it is not Unicode text and
    cannot be encoded as UTF-8), or None. Iterative: nesting depth does not matter."""
    todo: list[tuple[Any, tuple]] = [(data, ())]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return ".".join(map(str, path)) or "body"
        elif isinstance(value, dict):
            todo.extend((v, (*path, k)) for k, v in value.items())
            todo.extend((k, (*path, k)) for k in value if isinstance(k, str))
        elif isinstance(value, list):
            todo.extend((v, (*path, i)) for i, v in enumerate(value))
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class SamplingRequest(BaseModel):
    """Fields common to completions and chat completions. Floats must be finite
    (JSON's NaN / Infinity extensions are refused)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int64 | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions that vLLM accepts too (the openai client sends them through extra_body).
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    prompt_logprobs: Int64 | None = None  # top-N per prompt token, answered in vLLM's shape (not with stream)
    # specserve: false opts this request out of speculative decoding.
    speculative_decoding: bool | None = True
    # vLLM's structured-output extras (at most one; see server/params.py): a JSON schema
    # (an object, or JSON text), a regular expression, a list of strings to pick one of,
    # a grammar (EBNF or Lark).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where is not None:
            raise PydanticCustomError(
                "invalid_unicode",
                "'{where}' is not valid Unicode text (it holds a lone surrogate)",
                {"where": where, "param": where.split(".")[0]},
            )
        return data

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool | None = False
    logprobs: Int64 | None = None
    best_of: Int64 | None = None
    suffix: str | None = None  # refused: unsupported


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = None
    tools: list[Any] | None = None  # checked by server/tools.py
    tool_choice: Any = None
    functions: list[Any] | None = None  # refused: the deprecated form of tools
    # {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    response_format: dict[str, Any] | None = None


# ---- responses ----


def _now() -> int:
    return int(time.time())


class SpecDecodeUsage(BaseModel):
    """specserve's extension of ``usage``: speculative decoding of this request's choices."""

    num_drafts: int = 0  # rounds that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_acceptance_length: float = 1.0  # tokens per drafting round: 1 + accepted / drafts

    @classmethod
    def total(cls, summaries: list[dict]) -> "SpecDecodeUsage | None":
        """Summed over choices; None without speculation (every summary empty)."""
        summaries = [s for s in summaries if s]
        if not summaries:
            return None
        d, t, a = (sum(s[k] for s in summaries) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
        return cls(num_drafts=d, num_draft_tokens=t, num_accepted_tokens=a, mean_acceptance_length=1 + a / d if d else 1.0)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    spec_decode: SpecDecodeUsage | None = None  # present when the server speculates (zeros: no drafts)

    @model_serializer(mode="wrap")
    def _omit_empty_spec(self, handler):
        data = handler(self)
        if data.get("spec_decode") is None:
            data.pop("spec_decode", None)
        return data


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry of one token: its rank is 1 for the most likely."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs``: None for the first prompt token, then token id -> entry,
# the prompt token first, then the top N.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


def _omit_none(*names: str):
    """A serializer that leaves each of ``names`` out while it is None (extension fields)."""

    @model_serializer(mode="wrap")
    def serialize(self, handler):
        data = handler(self)
        for name in names:
            if data.get(name) is None:
                data.pop(name, None)
        return data

    return serialize


ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class ChoiceList(BaseModel, Generic[ChoiceT]):
    """The envelope of every completion object: a subclass names its choice type
    and pins ``object`` to a literal; the fields keep this order on the wire."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChoiceT]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension: sent only when asked
    speculative_decoding_stats: dict | None = None  # vLLM's: --per-request-spec-decode-stats (server.spec_stats)

    _serialize = _omit_none("prompt_logprobs", "speculative_decoding_stats")


class CompletionResponse(ChoiceList[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # the arguments object as JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None  # a piece of the arguments' JSON text, to append

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A piece of tool call ``index`` in a stream delta (OpenAI's shape): the first has
    the call's id, type and name with ``arguments: ""``; the next ones only a piece of
    the arguments' text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None  # left out when the answer is not a tool call

    @model_serializer(mode="wrap")
    def _omit_no_tool_calls(self, handler):
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    speculative_decoding_stats: dict | None = None  # vLLM's: --per-request-spec-decode-stats (server.spec_stats)

    _serialize = _omit_none("speculative_decoding_stats")


class ChatCompletionResponse(ChoiceList[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension: sent only when asked

    _serialize = _omit_none("prompt_logprobs")


class DeltaMessage(BaseModel):
    """A chat stream delta: only the fields that are set are sent."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    speculative_decoding_stats: dict | None = None  # on the choice's terminal chunk (server.spec_stats)

    _serialize = _omit_none("speculative_decoding_stats")


class ChatCompletionChunk(ChoiceList[ChatStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "specserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
