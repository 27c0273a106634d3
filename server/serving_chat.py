"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template.

One prompt, n choices. A stream sends, per choice, a first chunk with
``delta: {"role": "assistant", "content": ""}``, then content chunks, then a
chunk with an empty delta and the finish reason (OpenAI's sequence).

Structured outputs: ``response_format`` or a ``guided_*`` field becomes the
request's grammar (server/params.py). Tools (server/tools.py): rendered into the
prompt; a required or named call is a grammar too; an answer that parses as a
call comes back as ``tool_calls`` (in a stream: piece by piece as it is written,
server/tool_calls.py).
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
from server.params import choice_params, unsupported
from server.responses import ChoiceResult, respond
from server.serving import ServingEngine
from server.spec_stats import SpecStats
from server.tool_calls import CallStream
from server.tools import Tools, render_call_history, request_tools, tool_instruction


class ChatServing:
    def __init__(self, serving: ServingEngine):
        self.serving = serving
        self.decode = TokenDecoder(serving.tokenizer)
        self.spec_stats = SpecStats.of(serving)

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.serving.check_model(req.model)
        tools = request_tools(req)
        ids = self._prompt_ids(req.messages, tools)
        params = choice_params(
            req, max_n=self.serving.settings.max_n, max_tokens=self._max_tokens(req, len(ids)),
            logprobs=_engine_logprobs(req), prompt_logprobs=req.prompt_logprobs,
            tool_guided=tools.guided if tools is not None else None, defaults=self.serving.sampling_defaults,
        )
        n = len(params)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = await self.serving.submit(cid, [(ids, p) for p in params])
        gen.watch_disconnect(raw.receive)
        view = _View(cid, model, n, len(ids), self.decode, bool(req.logprobs), req.prompt_logprobs,
                     req.include_usage, tools, self.spec_stats)
        return await respond(gen, view, bool(req.stream))

    def _prompt_ids(self, messages: list[ChatMessage], tools: Tools | None) -> list[int]:
        if not messages:
            raise bad_request("messages must not be empty", param="messages")
        plain = [_plain(m, i) for i, m in enumerate(messages)]
        tokenizer, extra = self.serving.tokenizer, {}
        if tools is not None:
            if "tools" in (tokenizer.chat_template or ""):
                extra["tools"] = [{"type": "function", "function": f} for f in tools.functions]
            elif plain[0]["role"] == "system":
                plain[0] = {**plain[0], "content": plain[0]["content"] + "\n\n" + tool_instruction(tools)}
            else:
                plain.insert(0, {"role": "system", "content": tool_instruction(tools)})
        try:
            text = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False, **extra)
        except jinja2.TemplateError as e:
            raise bad_request(f"the chat template rejected these messages: {e}", param="messages") from None
        return self.serving.tokenize(text)

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


def _plain(message: ChatMessage, index: int) -> dict:
    """A message as the chat template takes it; an assistant's earlier tool calls in the call format."""
    plain = {"role": _role(message.role), "content": _content(message, index)}
    if message.tool_calls:
        plain["content"] = render_call_history(plain, message.tool_calls, f"messages.{index}.tool_calls")
    return plain


def _role(role: str) -> str:
    return "system" if role == "developer" else role


def _content(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for j, part in enumerate(message.content):
        if part.type != "text":
            raise unsupported(f"messages.{index}.content", f" (content part of type '{part.type}'; only text)")
        if part.text is None:
            where = f"messages.{index}.content"
            raise bad_request(f"{where}.{j} is a text part without its 'text'", param=where)
        texts.append(part.text)
    return "".join(texts)


def _engine_logprobs(req: ChatCompletionRequest) -> int | None:
    if not req.logprobs:
        if req.top_logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        return None
    return 0 if req.top_logprobs is None else req.top_logprobs


def could_be_call(tools: Tools, text: str) -> bool:
    """Whether ``text``, the start of an answer, may still become a tool call."""
    if tools.choice != "auto":
        return True
    head = text.lstrip()
    return not head or head[0] in "{[" or head.startswith("<tool_call>") or "<tool_call>".startswith(head)


class _View:
    """Renders one request's engine deltas as OpenAI chat objects.

    With tools, a streamed choice's text goes through a ``CallStream`` while it may
    still be a tool call (all of it under a required call; in "auto" while it starts
    like one, see ``could_be_call``): once a call's name is written its pieces go out
    as ``tool_calls`` deltas (id, type and name first, then the arguments' text as it
    comes) and the choice ends with finish_reason "tool_calls"; once it cannot be a
    call, the text held so far goes out as content.
    """

    def __init__(self, cid, model, n, num_prompt_tokens, decode, want_logprobs, prompt_logprobs, include_usage,
                 tools=None, spec_stats: SpecStats | None = None):
        self.cid, self.model, self.num_prompt_tokens = cid, model, num_prompt_tokens
        self.decode, self.want_logprobs, self.include_usage = decode, want_logprobs, include_usage
        self.prompt_logprobs = prompt_logprobs  # top-N asked (vLLM's extra), or None
        self.tools: Tools | None = tools
        self.spec_stats = spec_stats
        self.created = int(time.time())
        self.started = [False] * n
        self.completion_tokens = [0] * n
        self.spec = [{}] * n
        self.calls: list[CallStream | None] = [CallStream(tools.names) if tools else None for _ in range(n)]
        self.held_logprobs: list[list] = [[] for _ in range(n)]

    def render(self, index: int, out: RequestOutput):
        if not self.started[index]:
            self.started[index] = True
            yield self._chunk(index, DeltaMessage(role="assistant", content=""))
        self.completion_tokens[index] = out.num_output_tokens
        if out.finished:
            self.spec[index] = out.spec
        text, logprobs = out.new_text, out.logprobs or []
        if self.calls[index] is not None:
            text, logprobs = yield from self._render_calls(index, out)
            if text is None:
                return
        if text or (self.want_logprobs and logprobs):
            yield self._chunk(index, DeltaMessage(content=text), self._logprobs(logprobs))
        if out.finished:
            yield self._chunk(index, DeltaMessage(), finish_reason=out.finish_reason, stats=self._stats(out.spec))

    def _render_calls(self, index: int, out: RequestOutput):
        """Tool-call pieces of this delta; returns (None, None) when the delta is done, or the
        text and logprobs to send as content (the answer is not a call)."""
        stream = self.calls[index]
        logprobs = self.held_logprobs[index] + (out.logprobs or [])
        pieces = stream.feed(out.new_text)
        if stream.started:
            if not pieces and not out.finished:  # tokens that add no piece (a closing brace): their logprobs wait
                self.held_logprobs[index] = logprobs
                return None, None
            self.held_logprobs[index] = []
            for i, piece in enumerate(pieces):
                yield self._chunk(index, DeltaMessage(tool_calls=[piece]), self._logprobs(logprobs) if i == 0 else None)
            if out.finished:
                reason = "tool_calls" if out.finish_reason == "stop" else out.finish_reason
                yield self._chunk(index, DeltaMessage(), None if pieces else self._logprobs(logprobs), reason,
                                  stats=self._stats(out.spec))
            return None, None
        if not (out.finished or stream.rejected or not could_be_call(self.tools, stream.text)):
            self.held_logprobs[index] = logprobs
            return None, None
        self.calls[index] = None
        return stream.text, logprobs

    def _logprobs(self, logprobs: list) -> ChatChoiceLogprobs | None:
        return ChatChoiceLogprobs(content=chat_logprobs(logprobs, self.decode)) if self.want_logprobs else None

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

    def _stats(self, spec: dict) -> dict | None:
        return self.spec_stats.of_choice(spec) if self.spec_stats else None

    def _chunk(self, index, delta, logprobs=None, finish_reason=None, stats=None) -> str:
        choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                  speculative_decoding_stats=stats)
        chunk = ChatCompletionChunk(id=self.cid, created=self.created, model=self.model, choices=[choice])
        return sse_chunk(chunk, include_usage=self.include_usage)

    def response(self, results: list[ChoiceResult]) -> ChatCompletionResponse:
        choices = []
        for i, r in enumerate(results):
            calls = self.tools.parse(r.text) if self.tools is not None else None
            message = ChatResponseMessage(content=None, tool_calls=calls) if calls else ChatResponseMessage(content=r.text)
            choices.append(ChatChoice(
                index=i, message=message, logprobs=self._logprobs(r.logprobs),
                finish_reason="tool_calls" if calls else r.finish_reason, speculative_decoding_stats=self._stats(r.spec),
            ))
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
