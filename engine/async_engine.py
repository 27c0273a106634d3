"""The async engine client: the engine loop on its own thread, streams for asyncio.

``add_request`` hands the request to the engine thread, which validates and
adds it (``LLMEngine.add_request``: the one place a request is validated); it
raises the engine's refusal (``InvalidParameter``, a duplicate id) or returns
an async iterator of ``RequestOutput`` deltas, the last one with
``finished=True``. ``abort`` ends a request and frees its KV blocks (called,
for example, when an HTTP client disconnects). Requests and aborts cross to the
engine thread through a queue; answers and outputs come back through
``loop.call_soon_threadsafe``.

The server talks only to this class, never to the ``LLMEngine`` (not
thread-safe): ``tokenize`` and ``max_model_len`` read immutable state, and
``snapshot`` is the engine's state as the engine thread last pushed it.
"""

import asyncio
import logging
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.core.stats import EngineSnapshot

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: "asyncio.Queue[RequestOutput | BaseException]"
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future  # None once the engine added the request, or its refusal


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}
        self._stopping = threading.Event()
        self._stopped = threading.Event()  # set once the loop has ended; the inbox is then drained by whoever sees it
        self._wakeup = threading.Event()
        self.dead_error: BaseException | None = None
        self.snapshot: EngineSnapshot = engine.snapshot()  # replaced, never mutated, by the engine thread
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set() and self.dead_error is None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    @property
    def stat_loggers(self) -> list:
        """Called with each step's ``StepStats`` on the engine thread."""
        return self.engine.stat_loggers

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def sampling_defaults(self) -> dict:
        return self.engine.sampling_defaults

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenize(text)

    def speculation(self) -> tuple[bool, int]:
        """Whether the engine speculates (a drafter is configured), and the configured most
        drafts per step: fixed at construction."""
        return self.engine.speculator.drafter is not None, self.engine.config.speculative.num_speculative_tokens

    def device_info(self) -> dict[str, str]:
        """Where the engine runs, for ``/health``: its device, why that one, its attention backend."""
        choice = self.engine.device_choice
        return {"device": str(choice.device), "device_reason": choice.reason,
                "attention_backend": self.engine.runner.attention.name}

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Hands the request to the engine thread; raises its refusal (InvalidParameter,
        ValueError for an id in use, EngineDeadError) or returns the delta stream."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        self._inbox.put(_Add(request_id, prompt, params, stream, loop, accepted))
        self._wakeup.set()
        if self._stopped.is_set():  # the loop ended meanwhile: it may not see this request (no hang)
            self._refuse_inbox()
        try:
            await accepted
        except asyncio.CancelledError:  # the caller went away: the engine may have added it
            self.abort(request_id)
            raise
        return iterate_stream(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))
        self._wakeup.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout)

    # ---- engine thread ----

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self.engine.check_health()  # a dead tensor-parallel worker ends the loop: the server answers 503
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wakeup.wait(0.5)
                    self._wakeup.clear()
                    continue
                self._step()
                self.snapshot = self.engine.snapshot()
        except BaseException as e:  # the loop must report whatever killed it
            log.exception("engine loop died")
            self.dead_error = e
        finally:
            self._stopped.set()
            self._fail_all(EngineDeadError("the engine stopped"))
            self._refuse_inbox()

    def _take_inbox(self) -> Iterator[_Add | _Abort]:
        """The messages in the inbox, oldest first, until it is empty; each is
        taken once, so both threads may drain it."""
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            yield msg

    def _drain_inbox(self) -> None:
        for msg in self._take_inbox():
            if isinstance(msg, _Add):
                self._start(msg)
            elif (out := self.engine.abort_request(msg.request_id)) is not None:
                self._deliver(out)
        self.snapshot = self.engine.snapshot()

    def _start(self, msg: _Add) -> None:
        try:
            self.engine.add_request(msg.request_id, msg.prompt, msg.params)
        except Exception as e:  # noqa: BLE001 - the caller's refusal
            _answer(msg, e)
            return
        self._streams[msg.request_id] = msg
        if not _answer(msg, None):  # nobody waits for it any more
            del self._streams[msg.request_id]
            self.engine.abort_request(msg.request_id)

    def _step(self) -> None:
        deliver_step(self._streams, step_outputs(self.engine, self._streams), self.engine.abort_request)

    def _deliver(self, out: RequestOutput) -> None:
        msg = self._streams.get(out.request_id)
        if msg is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        if not _send(msg, out) and not out.finished:  # nobody can read this stream any more
            del self._streams[out.request_id]
            self.engine.abort_request(out.request_id)

    def _refuse_inbox(self) -> None:
        """After the loop ended: fail requests still in the inbox (either thread may call this;
        each message is taken once). Aborts need nothing: their requests were failed already."""
        for msg in self._take_inbox():
            if isinstance(msg, _Add):
                _answer(msg, EngineDeadError("the engine stopped"))

    def _fail_all(self, error: BaseException) -> None:
        for rid, msg in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)  # frees its blocks, if the engine's state still allows it
            except Exception:  # every stream must still get its error
                log.exception("could not abort %s", rid)
            _send(msg, error)
        self._streams.clear()


def step_outputs(engine: LLMEngine, live) -> list[RequestOutput]:
    """One step's outputs. A step that raises fails its running requests and the server
    keeps serving; requests in ``live`` (ids with a stream) that ended inside the failed
    step lost their last delta, so their streams end with the error too."""
    try:
        return engine.step()
    except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving
        log.error("engine step failed: %s", traceback.format_exc())
        error = f"internal error: {type(e).__name__}"
        failed = engine.fail_running(error)
        done = {out.request_id for out in failed}
        return failed + [
            RequestOutput(rid, [], "", finished=True, finish_reason="error", error=error)
            for rid in live
            if not engine.has_request(rid) and rid not in done
        ]


async def iterate_stream(client, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
    """A request's deltas from its stream until the finished one; ``client.abort`` ends the
    request when the consumer goes away first (client disconnect, cancellation)."""
    finished = False
    try:
        while True:
            item = await stream.get()
            if isinstance(item, BaseException):
                finished = True  # never added, or already ended by the engine: nothing to abort
                raise item
            yield item
            if item.finished:
                finished = True
                return
    finally:
        if not finished:
            client.abort(request_id)


def deliver_step(streams: dict[str, _Add], outputs: list[RequestOutput], abort) -> None:
    """A step's outputs onto their streams, handed to each event loop in one call: one
    wake-up of the loop per step, not one per request. A finished request leaves
    ``streams``; one whose event loop has closed is dropped and ended with ``abort(id)``."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Add, RequestOutput]]] = {}
    for out in outputs:
        msg = streams.get(out.request_id)
        if msg is None:
            continue
        if out.finished:
            del streams[out.request_id]
        by_loop.setdefault(msg.loop, []).append((msg, out))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # "Event loop is closed": nobody can read these streams any more
            for msg, out in items:
                if not out.finished:
                    streams.pop(out.request_id, None)
                    abort(out.request_id)


def _put_all(items: list[tuple[_Add, RequestOutput]]) -> None:
    """On the event loop: one step's outputs onto their streams."""
    for msg, out in items:
        msg.stream.put_nowait(out)


def _answer(msg: _Add, error: BaseException | None) -> bool:
    """Resolves the caller's ``accepted`` future from the engine thread: None (added) or
    the refusal. False when the caller's event loop is closed."""

    def resolve():
        if msg.accepted.done():  # cancelled meanwhile: add_request aborts it
            return
        if error is None:
            msg.accepted.set_result(None)
        else:
            msg.accepted.set_exception(error)

    try:
        msg.loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # "Event loop is closed"
        return False
    return True


def _send(msg: _Add, item) -> bool:
    """Puts ``item`` on the stream from the engine thread; False when the
    consumer's event loop is closed (which must not kill the engine loop)."""
    try:
        msg.loop.call_soon_threadsafe(msg.stream.put_nowait, item)
    except RuntimeError:  # "Event loop is closed"
        return False
    return True
