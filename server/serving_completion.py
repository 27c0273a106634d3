"""POST /v1/completions: prompts in, text completions (whole or streamed) out.

A request with P prompts and n choices starts P * n engine requests; choice
``p * n + i`` is the i-th completion of prompt p (OpenAI's order). Usage counts
each prompt once and every choice's output.

With ``echo`` the choice's text starts with the prompt, and with ``logprobs``
too its logprobs start with the prompt's (from the prefill; the first token's
are ``null``), then the generated tokens'. ``max_tokens: 0`` scores the prompt
only (lm-evaluation-harness's loglikelihood requests). vLLM's
``prompt_logprobs`` add each choice's ``prompt_logprobs`` in vLLM's shape.
"""

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from api.errors import bad_request
from api.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    SpecDecodeUsage,
    Usage,
)
from api.sse import sse_chunk
from engine.outputs import RequestOutput
from server.logprobs import TokenDecoder, completion_logprobs, echo_logprobs, vllm_prompt_logprobs
from server.params import choice_params
from server.responses import ChoiceResult, respond
from server.serving import ServingEngine
from server.spec_stats import SpecStats

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for legacy completions


class CompletionServing:
    def __init__(self, serving: ServingEngine):
        self.serving = serving
        self.decode = TokenDecoder(serving.tokenizer)
        self.spec_stats = SpecStats.of(serving)

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.serving.check_model(req.model)
        scored = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        params = choice_params(req, max_n=self.serving.settings.max_n, max_tokens=max_tokens, logprobs=req.logprobs,
                               prompt_logprobs=max(scored) if scored else None, defaults=self.serving.sampling_defaults)
        n = len(params)
        prompts = self._prompt_ids(req.prompt)
        cid = f"cmpl-{uuid.uuid4().hex}"
        gen = await self.serving.submit(cid, [(ids, p) for ids in prompts for p in params])
        gen.watch_disconnect(raw.receive)
        echo = [self._prompt_text(req.prompt, i, ids) for i, ids in enumerate(prompts)] if req.echo else None
        view = _View(cid, model, n, prompts, echo, self.decode, req.logprobs, req.prompt_logprobs, req.include_usage,
                     self.spec_stats)
        return await respond(gen, view, bool(req.stream))

    def _prompt_ids(self, prompt) -> list[list[int]]:
        """The prompt in any of its four shapes, as one token-id list per prompt."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return [self.serving.tokenize(p) if isinstance(p, str) else list(p) for p in prompt]

    def _prompt_text(self, prompt, index: int, ids: list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[index], str):
            return prompt[index]
        return self.serving.tokenizer.decode(ids)


class _View:
    """Renders one request's engine deltas as OpenAI completion objects."""

    def __init__(self, cid, model, n, prompts, echo, decode, logprobs, prompt_logprobs, include_usage,
                 spec_stats: SpecStats | None = None):
        self.cid, self.model, self.n, self.prompts, self.echo = cid, model, n, prompts, echo
        self.decode, self.include_usage, self.spec_stats = decode, include_usage, spec_stats
        self.logprobs, self.prompt_logprobs = logprobs, prompt_logprobs  # top-N asked, or None
        self.created = int(time.time())
        k = len(prompts) * n
        self.started = [False] * k
        self.offsets = [0] * k  # text offset of the next token, per choice
        self.completion_tokens = [0] * k
        self.spec = [{}] * k

    def _echo(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def _logprobs(self, index: int, offset: int, lps, prompt_lps) -> tuple[CompletionLogprobs | None, int]:
        """The legacy logprobs of ``lps`` from ``offset``, after the echoed prompt's when
        ``prompt_lps`` (the first delta's) is given; and the offset after them."""
        if self.logprobs is None:
            return None, offset
        if not (self.echo and prompt_lps is not None):
            return completion_logprobs(lps, self.decode, offset)
        out, offset = echo_logprobs(self.prompts[index // self.n], prompt_lps, self.logprobs, self.decode)
        tail, offset = completion_logprobs(lps, self.decode, offset)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(out, name).extend(getattr(tail, name))
        return out, offset

    def render(self, index: int, out: RequestOutput):
        """Streams carry the echoed prompt (and its logprobs) in the choice's first chunk."""
        text = out.new_text
        if not self.started[index]:
            self.started[index] = True
            text = self._echo(index) + text
        self.completion_tokens[index] = out.num_output_tokens
        if out.finished:
            self.spec[index] = out.spec
        lps, prompt_lps = out.logprobs or [], out.prompt_logprobs
        logprobs, self.offsets[index] = self._logprobs(index, self.offsets[index], lps, prompt_lps)
        if not (text or out.new_token_ids or out.finished):
            return
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                                  speculative_decoding_stats=self._stats(out.spec) if out.finished else None)
        yield sse_chunk(self._response([choice]), include_usage=self.include_usage)

    def tail(self):
        if self.include_usage:
            yield sse_chunk(self._response([], self._usage(sum(self.completion_tokens), self.spec)), include_usage=True)

    def response(self, results: list[ChoiceResult]) -> CompletionResponse:
        choices = []
        for i, r in enumerate(results):
            lp = self._logprobs(i, 0, r.logprobs, r.prompt_logprobs)[0]
            prompt_lp = None
            if self.prompt_logprobs is not None and r.prompt_logprobs is not None:
                prompt_lp = vllm_prompt_logprobs(r.prompt_logprobs, self.prompt_logprobs, self.decode)
            choices.append(
                CompletionChoice(
                    index=i, text=self._echo(i) + r.text, logprobs=lp, finish_reason=r.finish_reason,
                    prompt_logprobs=prompt_lp, speculative_decoding_stats=self._stats(r.spec),
                )
            )
        return self._response(choices, self._usage(sum(r.num_output_tokens for r in results), [r.spec for r in results]))

    def _stats(self, spec: dict) -> dict | None:
        return self.spec_stats.of_choice(spec) if self.spec_stats else None

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
