"""The engine core in its own process, as vLLM's EngineCore: the front end's event
loop and the engine's Python never wait on one interpreter lock.

``EngineCoreClient`` is the server's engine (the same calls as ``AsyncEngine``):
it spawns a process that builds the ``LLMEngine`` from the config and loops,
taking requests and aborts from a pipe, stepping, and sending each step's
outputs back in one message with the engine's snapshot and step statistics. A
thread of the front end reads the pipe and hands each step's outputs to the
event loops, exactly as the engine thread does in ``AsyncEngine``.

Only plain data crosses: request ids, token ids, ``SamplingParams``,
``RequestOutput`` deltas, ``EngineSnapshot`` and ``StepStats``. A refusal
crosses as (class name, param, message) and is raised again in the front end.
The core exits when the pipe closes (the front end stopped or died), so it never
outlives the server.
"""

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Callable

from engine.async_engine import EngineDeadError, _Add, _answer, _send, deliver_step, iterate_stream, step_outputs
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import InvalidParameter, SamplingParams
from engine.core.stats import EngineSnapshot

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a model (and, on a GPU, capturing graphs) before the core says it is ready
IDLE_POLL_S = 0.5  # an idle core's wait for a message between health checks


def _refusal(e: BaseException) -> tuple[str, str, str]:
    if isinstance(e, InvalidParameter):
        return ("InvalidParameter", e.param, str(e)[len(e.param) + 1:])
    return (type(e).__name__, "", str(e))


def _raise_refusal(kind: str, param: str, message: str) -> BaseException:
    if kind == "InvalidParameter":
        return InvalidParameter(param, message)
    if kind == "ValueError":
        return ValueError(message)
    return RuntimeError(f"{kind}: {message}")


def run_core(config: EngineConfig, conn, log_setup: Callable[[], None] | None = None) -> None:
    """The core process's entry point (a ``multiprocessing`` spawn target); ``log_setup``
    configures its logging as the server's (a picklable callable, such as a ``partial``)."""
    if log_setup is not None:
        log_setup()
    else:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        from engine.llm_engine import LLMEngine
        from engine.utils.heap import freeze_startup_heap

        engine = LLMEngine(config)
        freeze_startup_heap()
    except BaseException:  # noqa: BLE001 - the front end reports why the core could not start
        conn.send(("failed", traceback.format_exc()))
        return
    stats: list = []
    engine.stat_loggers.append(stats.append)
    conn.send(("ready", {
        "tokenizer": engine.tokenizer,
        "max_model_len": engine.max_model_len,
        "model_path": engine.model_path,
        "sampling_defaults": engine.sampling_defaults,
        "speculation": (engine.speculator.drafter is not None, config.speculative.num_speculative_tokens),
        "device_info": {"device": str(engine.device_choice.device), "device_reason": engine.device_choice.reason,
                        "attention_backend": engine.runner.attention.name},
        "snapshot": engine.snapshot(),
    }))
    try:
        _core_loop(engine, conn, stats)
    except (EOFError, OSError, KeyboardInterrupt):  # the front end went away
        pass
    except BaseException:
        log.exception("engine core died")  # the front end sees the pipe close and fails every stream
        raise
    finally:
        engine.close()


def _core_loop(engine, conn, stats: list) -> None:
    live: set[str] = set()  # requests added and not yet ended
    while True:
        engine.check_health()  # a dead tensor-parallel worker ends the core: the front end answers 503
        outputs: list[RequestOutput] = []
        busy = engine.has_unfinished()
        wait = 0.0 if busy else IDLE_POLL_S  # idle: wait on the pipe, checking health now and then
        while conn.poll(wait):
            wait, busy = 0.0, True
            msg = conn.recv()
            if msg[0] == "add":
                _, rid, prompt, params = msg
                try:
                    engine.add_request(rid, prompt, params)
                except Exception as e:  # noqa: BLE001 - the caller's refusal
                    conn.send(("refused", rid, _refusal(e)))
                    continue
                live.add(rid)
                conn.send(("added", rid))
            elif msg[0] == "abort":
                if (out := engine.abort_request(msg[1])) is not None:
                    outputs.append(out)
            elif msg[0] == "stop":
                return
        if not busy:
            continue
        if engine.has_unfinished():
            outputs += step_outputs(engine, live)
        for out in outputs:
            if out.finished:
                live.discard(out.request_id)
        conn.send(("step", outputs, engine.snapshot(), stats[:]))
        stats.clear()


class EngineCoreClient:
    """The front end of a core process: ``AsyncEngine``'s interface over a pipe."""

    def __init__(self, config: EngineConfig, log_setup: Callable[[], None] | None = None):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # Not a daemon: the core starts tensor-parallel workers of its own. It exits when the pipe closes.
        self._proc = ctx.Process(target=run_core, args=(config, child, log_setup), name="specserve-engine-core")
        self._proc.start()
        child.close()
        self.config = config
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # to the core, sent by the writer thread
        self._streams: dict[str, _Add] = {}
        self._adding: dict[str, _Add] = {}  # sent, not yet answered by the core
        self.stat_loggers: list[Callable] = []  # called with each step's StepStats on the reader thread
        self.dead_error: BaseException | None = None
        self._stopping = False
        if not self._conn.poll(START_TIMEOUT_S):
            self._proc.kill()
            raise RuntimeError(f"the engine core did not start within {START_TIMEOUT_S:.0f} s")
        try:
            kind, info = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine core exited while starting (exit code {self._proc.exitcode})") from None
        if kind == "failed":
            self._proc.join(5)
            raise RuntimeError(f"the engine core could not start:\n{info}")
        self.tokenizer = info["tokenizer"]
        self.max_model_len: int = info["max_model_len"]
        self.model_path: str = info["model_path"]
        self.sampling_defaults: dict = info["sampling_defaults"]
        self._speculation: tuple[bool, int] = info["speculation"]
        self._device_info: dict[str, str] = info["device_info"]
        self.snapshot: EngineSnapshot = info["snapshot"]
        self._reader = threading.Thread(target=self._read, name="specserve-engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="specserve-engine-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self._stopping and self._proc.is_alive()

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def speculation(self) -> tuple[bool, int]:
        return self._speculation

    def device_info(self) -> dict[str, str]:
        return dict(self._device_info)

    def _post(self, msg: tuple | None) -> None:
        """Queues ``msg`` for the core (None: no more); never blocks the event loop, even
        while the core is inside a long step and the pipe is full."""
        self._outbox.put(msg)

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        add = _Add(request_id, prompt, params, stream, loop, loop.create_future())
        self._adding[request_id] = add
        self._post(("add", request_id, prompt, params))
        if self.dead_error is not None and self._adding.pop(request_id, None) is not None:
            raise EngineDeadError("the engine stopped")  # died meanwhile, after the reader failed the others
        try:
            await add.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return iterate_stream(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))  # a no-op once the core is gone: its requests were failed already

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._post(("stop",))
        self._post(None)
        self._writer.join(timeout)
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()
        self._reader.join(timeout)

    # ---- writer and reader threads ----

    def _write(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn.send(msg)
            except (OSError, ValueError):  # the core is gone (the reader fails the streams), or the pipe closed
                return

    def _read(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "step":
                    _, outputs, snapshot, stats = msg
                    self.snapshot = snapshot
                    deliver_step(self._streams, outputs, self.abort)
                    for s in stats:
                        for logger in self.stat_loggers:
                            try:
                                logger(s)
                            except Exception:
                                log.exception("stat logger failed")
                elif kind == "added":
                    add = self._adding.pop(msg[1], None)
                    if add is not None:
                        self._streams[add.request_id] = add
                        if not _answer(add, None):
                            del self._streams[add.request_id]
                            self.abort(add.request_id)
                elif kind == "refused":
                    add = self._adding.pop(msg[1], None)
                    if add is not None:
                        _answer(add, _raise_refusal(*msg[2]))
        except (EOFError, OSError):
            if not self._stopping:
                log.error("the engine core exited (exit code %s)", self._proc.exitcode)
        except BaseException as e:
            log.exception("engine core reader died")
            self.dead_error = e
        finally:
            if self.dead_error is None:
                self.dead_error = EngineDeadError("the engine stopped")
            error = EngineDeadError("the engine stopped")
            for add in list(self._adding.values()):
                _answer(add, error)
            self._adding.clear()
            for add in list(self._streams.values()):
                _send(add, error)
            self._streams.clear()
