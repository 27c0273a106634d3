"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template.

One prompt, n choices. A stream sends, per choice, a first chunk with
``delta: {"role": "assistant", "content": ""}``, then content chunks, then a
chunk with an empty delta and the finish reason (OpenAI's sequence).
"""

import time
import uuid

import jinja2
from fastapi import Request
from fastapi.responses import Response

from api.errors import bad_request
from api.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    SpecDecodeUsage,
    Usage,
)
from api.sse import sse_chunk
from engine.outputs import RequestOutput
from server.logprobs import TokenDecoder, chat_logprobs, vllm_prompt_logprobs
from server.params import build_params, check_n, check_prompt_logprobs, per_choice, unsupported
from server.responses import ChoiceResult, respond
from server.serving import ServingEngine


class ChatServing:
    def __init__(self, serving: ServingEngine):
        self.serving = serving
        self.decode = TokenDecoder(serving.tokenizer)

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.serving.check_model(req.model)
        n = check_n(req.n, self.serving.settings.max_n)
        _refuse_unsupported(req)
        check_prompt_logprobs(req)
        ids = self._prompt_ids(req.messages)
        params = build_params(req, self._max_tokens(req, len(ids)), _engine_logprobs(req), req.prompt_logprobs)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = await self.serving.submit(cid, [(ids, p) for p in per_choice(params, n)])
        gen.watch_disconnect(raw.receive)
        view = _View(cid, model, n, len(ids), self.decode, bool(req.logprobs), req.prompt_logprobs, req.include_usage)
        return await respond(gen, view, bool(req.stream))

    def _prompt_ids(self, messages: list[ChatMessage]) -> list[int]:
        if not messages:
            raise bad_request("messages must not be empty", param="messages")
        plain = [{"role": _role(m.role), "content": _content(m, i)} for i, m in enumerate(messages)]
        try:
            text = self.serving.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateError as e:
            raise bad_request(f"the chat template rejected these messages: {e}", param="messages") from None
        return self.serving.llm.tokenize(text)

    def _max_tokens(self, req: ChatCompletionRequest, num_prompt_tokens: int) -> int:
        """The request's limit, or else the rest of the context (OpenAI's default)."""
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if limit is not None:
            return limit
        room = self.serving.max_model_len - num_prompt_tokens
        if room < 1:
            raise bad_request(
                f"the messages take {num_prompt_tokens} tokens, the model's context is {self.serving.max_model_len}",
                param="messages",
                code="context_length_exceeded",
            )
        return room


def _role(role: str) -> str:
    return "system" if role == "developer" else role


def _content(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise unsupported(f"messages.{index}.content", f" (content part of type '{part.type}'; only text)")
        texts.append(part.text)
    return "".join(texts)


def _refuse_unsupported(req: ChatCompletionRequest) -> None:
    if req.tools or req.functions:
        raise unsupported("tools" if req.tools else "functions")
    if req.tool_choice not in (None, "none", "auto"):
        raise unsupported("tool_choice")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise unsupported("response_format", " (only type 'text')")


def _engine_logprobs(req: ChatCompletionRequest) -> int | None:
    if not req.logprobs:
        if req.top_logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        return None
    return 0 if req.top_logprobs is None else req.top_logprobs


class _View:
    """Renders one request's engine deltas as OpenAI chat objects."""

    def __init__(self, cid, model, n, num_prompt_tokens, decode, want_logprobs, prompt_logprobs, include_usage):
        self.cid, self.model, self.num_prompt_tokens = cid, model, num_prompt_tokens
        self.decode, self.want_logprobs, self.include_usage = decode, want_logprobs, include_usage
        self.prompt_logprobs = prompt_logprobs  # top-N asked (vLLM's extra), or None
        self.created = int(time.time())
        self.started = [False] * n
        self.completion_tokens = [0] * n
        self.spec = [{}] * n

    def render(self, index: int, out: RequestOutput):
        if not self.started[index]:
            self.started[index] = True
            yield self._chunk(index, DeltaMessage(role="assistant", content=""))
        self.completion_tokens[index] = out.num_output_tokens
        if out.finished:
            self.spec[index] = out.spec
        if out.new_text or (self.want_logprobs and out.logprobs):
            lp = (
                ChatChoiceLogprobs(content=chat_logprobs(out.logprobs or [], self.decode))
                if self.want_logprobs
                else None
            )
            yield self._chunk(index, DeltaMessage(content=out.new_text), lp)
        if out.finished:
            yield self._chunk(index, DeltaMessage(), finish_reason=out.finish_reason)

    def tail(self):
        if self.include_usage:
            chunk = ChatCompletionChunk(
                id=self.cid,
                created=self.created,
                model=self.model,
                choices=[],
                usage=self._usage(sum(self.completion_tokens), self.spec),
            )
            yield sse_chunk(chunk, include_usage=True)

    def _chunk(self, index, delta, logprobs=None, finish_reason=None) -> str:
        choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        chunk = ChatCompletionChunk(id=self.cid, created=self.created, model=self.model, choices=[choice])
        return sse_chunk(chunk, include_usage=self.include_usage)

    def response(self, results: list[ChoiceResult]) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i,
                message=ChatResponseMessage(content=r.text),
                logprobs=ChatChoiceLogprobs(content=chat_logprobs(r.logprobs, self.decode))
                if self.want_logprobs
                else None,
                finish_reason=r.finish_reason,
            )
            for i, r in enumerate(results)
        ]
        usage = self._usage(sum(r.num_output_tokens for r in results), [r.spec for r in results])
        prompt_lp = None  # the choices share the prompt: vLLM sends its logprobs once
        if self.prompt_logprobs is not None and results and results[0].prompt_logprobs is not None:
            prompt_lp = vllm_prompt_logprobs(results[0].prompt_logprobs, self.prompt_logprobs, self.decode)
        return ChatCompletionResponse(
            id=self.cid, created=self.created, model=self.model, choices=choices, usage=usage, prompt_logprobs=prompt_lp
        )

    def _usage(self, completion_tokens: int, spec: list[dict]) -> Usage:
        p = self.num_prompt_tokens
        return Usage(
            prompt_tokens=p,
            completion_tokens=completion_tokens,
            total_tokens=p + completion_tokens,
            spec_decode=SpecDecodeUsage.total(spec),
        )
