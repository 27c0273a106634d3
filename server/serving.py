"""The serving layer's core: HTTP requests in, engine requests out.

``ServingEngine.submit`` turns one HTTP request into one engine request per
choice (prompts x n): it applies admission (draining, dead engine, full
queue), submits them all (the engine validates each: a refusal is a 400 and
the choices already accepted are aborted), and returns a
``Generation`` whose ``stream()`` merges their delta streams into
``(choice_index, RequestOutput)`` pairs.

A generation always ends through ``Generation.close()`` (idempotent, sync):
from the consumer's ``finally``, or from the disconnect watcher the moment the
client goes away. ``close`` aborts every engine request that has not finished,
so its KV blocks are freed at the engine's next step, and reports metrics and
the one log line of the request. Graceful shutdown uses ``abort_all``, which
aborts without closing, so the streams still end with an error event.

Admission rules (the engine's scheduler does not bound its waiting queue yet):
``pending`` counts engine requests submitted that have produced no output; a
request that would push it above ``max_waiting`` gets a 503 with Retry-After,
and so does one that would make more than ``max_concurrent_requests`` HTTP
requests live at once.

Time limit: with ``max_request_seconds`` set, a generation still live after that
long is aborted; it ends like a shutdown abort, with a 504 ``request_timeout``
error (an error event and ``[DONE]`` when streaming).
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from api.errors import APIError, bad_request
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.outputs import RequestOutput
from engine.sampling_params import InvalidParameter, SamplingParams
from server.metrics import RequestStats, ServingMetrics
from server.settings import ServerSettings

log = logging.getLogger(__name__)

_END = object()  # a choice's stream is exhausted
_CLOSED = object()  # the generation was closed under the consumer (client disconnect)


class ClientGone(Exception):
    """The client disconnected; nobody reads the response."""


@dataclass
class _Choice:
    engine_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stats: RequestStats = field(default_factory=RequestStats)
    started: bool = False  # produced its first delta (no longer pending)
    finished: bool = False


class Generation:
    """The engine requests of one HTTP request. Consume ``stream()`` once; ``close()`` always."""

    def __init__(self, serving: "ServingEngine", request_id: str, choices: list[_Choice]):
        self.serving = serving
        self.request_id = request_id
        self.choices = choices
        self.abort_reason: str | None = None  # "disconnect" | "shutdown" | "timeout" once aborted
        self.closed = False
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._tasks: list[asyncio.Task] = []
        self._watcher: asyncio.Task | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._queue: asyncio.Queue = asyncio.Queue()  # (choice index, delta | exception | _END | _CLOSED)
        self.created = time.monotonic()

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Deltas of all choices, merged in arrival order. Raises ``ClientGone`` when the
        client went away, ``APIError`` for an engine failure or a shutdown abort.
        Closes the generation when it ends, however it ends."""
        try:
            if self.closed:
                raise self._closed_error()
            self._tasks = [asyncio.create_task(_pump(i, s, self._queue)) for i, s in enumerate(self._streams)]
            remaining = len(self._tasks)
            while remaining:
                index, item = await self._queue.get()
                if item is _END:
                    remaining -= 1
                elif item is _CLOSED:
                    raise self._closed_error()
                elif isinstance(item, BaseException):
                    raise _engine_failure(item)
                else:
                    self.serving._on_delta(self.choices[index], item)
                    if item.finished:
                        self._check_finish(item)
                    yield index, item
        finally:
            self.close()

    def _closed_error(self) -> Exception:
        if self.abort_reason == "disconnect":
            return ClientGone()
        if self.abort_reason == "timeout":
            return self._timeout_error()
        return APIError(500, "the request was closed before it finished", code="aborted")

    def _check_finish(self, out: RequestOutput) -> None:
        if out.finish_reason == "error":
            raise APIError(500, f"the engine failed on this request: {out.error}", code="engine_error")
        if out.finish_reason == "abort":
            if self.abort_reason == "shutdown":
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if self.abort_reason == "disconnect":
                raise ClientGone()
            if self.abort_reason == "timeout":
                raise self._timeout_error()
            raise APIError(500, "the request was aborted", code="aborted")

    def _timeout_error(self) -> APIError:
        limit = self.serving.settings.max_request_seconds
        return APIError(504, f"the request took longer than the server's limit of {limit} s", code="request_timeout")

    def set_deadline(self, seconds: float) -> None:
        """Abort this generation if it is still live ``seconds`` from now."""
        self._deadline = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        if not self.closed:
            log.warning("request time limit passed; aborting", extra={"fields": {"id": self.request_id}})
            self.abort("timeout")

    def watch_disconnect(self, receive: Callable) -> None:
        """Close this generation the moment the client disconnects."""
        self._watcher = asyncio.create_task(_watch(receive, self))

    def abort(self, reason: str) -> None:
        """Abort the unfinished engine requests; their streams end with finish_reason 'abort'."""
        self.abort_reason = self.abort_reason or reason
        for c in self.choices:
            if not c.finished:
                self.serving.engine.abort(c.engine_id)

    def close(self, reason: str = "done") -> None:
        """Release everything this generation holds. Idempotent; safe from any task."""
        if self.closed:
            return
        if any(not c.finished for c in self.choices):
            self.abort(reason)
        self.closed = True
        self._queue.put_nowait((None, _CLOSED))
        for t in self._tasks:
            t.cancel()
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
        if self._deadline is not None:
            self._deadline.cancel()
        self.serving._on_closed(self)


async def _pump(index: int, stream: AsyncIterator[RequestOutput], queue: asyncio.Queue) -> None:
    try:
        async for out in stream:
            queue.put_nowait((index, out))
    except Exception as e:  # noqa: BLE001 - handed to the consumer
        queue.put_nowait((index, e))
    finally:
        queue.put_nowait((index, _END))
        await stream.aclose()


async def _watch(receive: Callable, gen: Generation) -> None:
    while True:  # ends on disconnect or when close() cancels it
        message = await receive()
        if message["type"] == "http.disconnect":
            if not gen.closed:
                log.info("client disconnected; aborting", extra={"fields": {"id": gen.request_id}})
            gen.close("disconnect")
            return


def _engine_failure(error: BaseException) -> APIError:
    if isinstance(error, InvalidParameter):
        return bad_request(str(error), param=error.param)
    if isinstance(error, EngineDeadError):
        return APIError(503, "the engine is not running", code="engine_dead")
    if isinstance(error, APIError):
        return error
    return APIError(500, f"the engine failed: {type(error).__name__}", code="engine_error")


class ServingEngine:
    """Admission, tracking and metrics around one ``AsyncEngine``."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self.model_names = settings.model_names
        self.metrics = ServingMetrics(self.model_names[0], lambda: engine.snapshot)
        self.pending = 0
        self.live: dict[str, Generation] = {}
        self.draining = False
        self.ready = True  # False from SIGTERM on (server/run.py): /health answers 503

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def sampling_defaults(self) -> dict:
        """Sampling settings a request leaves unset take these (the checkpoint's generation config)."""
        return getattr(self.engine, "sampling_defaults", {})

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenize(text)

    def check_model(self, name: str | None) -> str:
        """The name to report; 404 for a name this server does not serve."""
        if name is None or name in self.model_names:
            return self.model_names[0]
        raise APIError(404, f"the model '{name}' does not exist", param="model", code="model_not_found")

    async def submit(self, request_id: str, requests: list[tuple[list[int], SamplingParams]]) -> Generation:
        """Admit and start one engine request per (prompt, params); see the module doc."""
        self._admit(len(requests))
        choices = [_Choice(f"{request_id}-{i}", ids, p) for i, (ids, p) in enumerate(requests)]
        gen = Generation(self, request_id, choices)
        self.live[request_id] = gen
        self.pending += len(choices)
        if self.settings.max_request_seconds is not None:
            gen.set_deadline(self.settings.max_request_seconds)
        try:
            for c in choices:
                gen._streams.append(await self.engine.add_request(c.engine_id, c.prompt_token_ids, c.params))
        except InvalidParameter as e:
            self._refused(gen)
            raise bad_request(str(e), param=e.param) from None
        except BaseException as e:
            gen.close("error")
            raise _engine_failure(e) from e
        return gen

    def _refused(self, gen: Generation) -> None:
        """The engine refused a choice: abort those it accepted; the request never started
        (no metrics, no log line)."""
        for c in gen.choices:
            self.engine.abort(c.engine_id)  # a no-op for the choices never added
        gen.closed = True
        self.live.pop(gen.request_id, None)
        self.pending -= len(gen.choices)
        if gen._deadline is not None:
            gen._deadline.cancel()

    def _admit(self, num_new: int) -> None:
        limit = self.settings.max_waiting
        if num_new > limit:
            raise bad_request(
                f"this request asks for {num_new} completions; the server takes at most {limit} at once", "n"
            )
        if self.draining:
            raise self._reject("shutting_down", "the server is shutting down", retry_after_s=5)
        if not self.engine.is_running:
            raise self._reject("engine_dead", "the engine is not running")
        concurrent = self.settings.max_concurrent_requests
        if concurrent is not None and len(self.live) >= concurrent:
            raise self._reject(
                "too_many_requests", f"the server is busy: {len(self.live)} requests are in flight", retry_after_s=1
            )
        if self.pending + num_new > limit:
            raise self._reject(
                "queue_full", f"the server is busy: {self.pending} requests are waiting", retry_after_s=1
            )

    def _reject(self, reason: str, message: str, retry_after_s: int | None = None) -> APIError:
        """A 503 refusal to raise, counted under ``reason`` (also its error code);
        ``retry_after_s`` becomes the Retry-After header."""
        self.metrics.on_rejected(reason)
        headers = None if retry_after_s is None else {"Retry-After": str(retry_after_s)}
        return APIError(503, message, code=reason, headers=headers)

    def _on_delta(self, choice: _Choice, out: RequestOutput) -> None:
        if choice.finished:  # closed already (an abort raced the engine's last delta): counted once
            return
        if not choice.started:
            choice.started = True
            self.pending -= 1
        choice.stats.num_prompt_tokens = out.num_prompt_tokens
        self.metrics.on_tokens(choice.stats, len(out.new_token_ids))
        if out.finished:
            choice.finished = True
            choice.stats.finish_reason = out.finish_reason
            self.metrics.on_finished(choice.stats)

    def _on_closed(self, gen: Generation) -> None:
        self.live.pop(gen.request_id, None)
        for c in gen.choices:
            if not c.started:
                c.started = True
                self.pending -= 1
            if not c.finished:
                c.finished = True
                c.stats.finish_reason = "abort"
                self.metrics.on_finished(c.stats)
        if not self.settings.disable_log_requests:
            self._log_done(gen)

    def _log_done(self, gen: Generation) -> None:
        stats = [c.stats for c in gen.choices]
        first = [s.first_token_time for s in stats if s.first_token_time is not None]
        fields = {
            "id": gen.request_id,
            "choices": len(stats),
            "prompt_tokens": sum(c.stats.num_prompt_tokens or len(c.prompt_token_ids) for c in gen.choices),
            "completion_tokens": sum(s.num_output_tokens for s in stats),
            "finish_reasons": sorted({s.finish_reason or "abort" for s in stats}),
            "ttft_s": (min(first) - gen.created) if first else None,
            "e2e_s": time.monotonic() - gen.created,
        }
        if gen.abort_reason:
            fields["aborted"] = gen.abort_reason
        log.info("generation done", extra={"fields": fields})

    def begin_drain(self, timeout: float) -> None:
        """Graceful shutdown: refuse new requests now; abort those still running after ``timeout`` s."""
        if self.draining:
            return
        self.draining = True
        log.info("draining", extra={"fields": {"in_flight": len(self.live), "timeout_s": timeout}})
        asyncio.get_running_loop().call_later(timeout, self._drain_deadline)

    def _drain_deadline(self) -> None:
        if aborted := self.abort_all("shutdown"):
            log.warning("shutdown timeout passed; aborted the requests left", extra={"fields": {"aborted": aborted}})

    def abort_all(self, reason: str) -> int:
        """Abort every live generation (graceful-shutdown deadline); returns how many."""
        gens = list(self.live.values())
        for gen in gens:
            gen.abort(reason)
        return len(gens)
