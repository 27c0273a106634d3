"""POST /v1/completions: prompts in, text completions (whole or streamed) out.

A request with P prompts and n choices starts P * n engine requests; choice
``p * n + i`` is the i-th completion of prompt p (OpenAI's order). Usage counts
each prompt once and every choice's output.
"""

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from api.errors import bad_request
from api.protocol import CompletionChoice, CompletionRequest, CompletionResponse, SpecDecodeUsage, Usage
from api.sse import sse_chunk
from engine.outputs import RequestOutput
from server.logprobs import TokenDecoder, completion_logprobs
from server.params import build_params, check_n, guided_decoding, per_choice, unsupported
from server.responses import ChoiceResult, respond
from server.serving import ServingEngine

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for legacy completions


class CompletionServing:
    def __init__(self, serving: ServingEngine):
        self.serving = serving
        self.decode = TokenDecoder(serving.tokenizer)

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.serving.check_model(req.model)
        n = check_n(req.n, self.serving.settings.max_n)
        _refuse_unsupported(req, n)
        prompts = self._prompt_ids(req.prompt)
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        params = build_params(req, max_tokens, req.logprobs, guided_decoding(req))
        cid = f"cmpl-{uuid.uuid4().hex}"
        gen = await self.serving.submit(cid, [(ids, p) for ids in prompts for p in per_choice(params, n)])
        gen.watch_disconnect(raw.receive)
        echo = [self._prompt_text(req.prompt, i, ids) for i, ids in enumerate(prompts)] if req.echo else None
        view = _View(cid, model, n, prompts, echo, self.decode, req.logprobs is not None, req.include_usage)
        return await respond(gen, view, bool(req.stream))

    def _prompt_ids(self, prompt) -> list[list[int]]:
        """The prompt in any of its four shapes, as one token-id list per prompt."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return [self.serving.llm.tokenize(p) if isinstance(p, str) else list(p) for p in prompt]

    def _prompt_text(self, prompt, index: int, ids: list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[index], str):
            return prompt[index]
        return self.serving.tokenizer.decode(ids)


def _refuse_unsupported(req: CompletionRequest, n: int) -> None:
    if req.suffix is not None:
        raise unsupported("suffix")
    if req.best_of is not None and req.best_of != n:
        raise unsupported("best_of", " (other than best_of == n)")
    if req.echo and req.logprobs is not None:
        raise unsupported("logprobs", " together with echo (no prompt logprobs)")


class _View:
    """Renders one request's engine deltas as OpenAI completion objects."""

    def __init__(self, cid, model, n, prompts, echo, decode, want_logprobs, include_usage):
        self.cid, self.model, self.n, self.prompts, self.echo = cid, model, n, prompts, echo
        self.decode, self.want_logprobs, self.include_usage = decode, want_logprobs, include_usage
        self.created = int(time.time())
        k = len(prompts) * n
        self.started = [False] * k
        self.offsets = [0] * k  # text offset of the next token, per choice
        self.completion_tokens = [0] * k
        self.spec = [{}] * k

    def _echo(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def render(self, index: int, out: RequestOutput):
        text = out.new_text
        if not self.started[index]:
            self.started[index] = True
            text = self._echo(index) + text
        self.completion_tokens[index] = out.num_output_tokens
        if out.finished:
            self.spec[index] = out.spec
        logprobs = None
        if self.want_logprobs:
            logprobs, self.offsets[index] = completion_logprobs(out.logprobs or [], self.decode, self.offsets[index])
        if not (text or out.new_token_ids or out.finished):
            return
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason)
        yield sse_chunk(self._response([choice]), include_usage=self.include_usage)

    def tail(self):
        if self.include_usage:
            yield sse_chunk(self._response([], self._usage(sum(self.completion_tokens), self.spec)), include_usage=True)

    def response(self, results: list[ChoiceResult]) -> CompletionResponse:
        choices = []
        for i, r in enumerate(results):
            lp = completion_logprobs(r.logprobs, self.decode, 0)[0] if self.want_logprobs else None
            choices.append(
                CompletionChoice(index=i, text=self._echo(i) + r.text, logprobs=lp, finish_reason=r.finish_reason)
            )
        return self._response(choices, self._usage(sum(r.num_output_tokens for r in results), [r.spec for r in results]))

    def _usage(self, completion_tokens: int, spec: list[dict]) -> Usage:
        prompt_tokens = sum(len(p) for p in self.prompts)
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            spec_decode=SpecDecodeUsage.total(spec),
        )

    def _response(self, choices, usage=None) -> CompletionResponse:
        return CompletionResponse(id=self.cid, created=self.created, model=self.model, choices=choices, usage=usage)
