"""Runs the engine on one worker thread and streams its outputs to asyncio callers.

All tensor work happens on the worker thread; the asyncio loop only enqueues messages
(add, abort, shutdown) and awaits per-request queues, so it stays responsive while a
step runs. Messages are applied at step boundaries: an aborted request (for example a
client that disconnected) stops within one engine step. When nothing is runnable, `idle_work` (training: one slice per call) runs between
message checks, so a request that arrives during training waits for at most one slice;
with no idle work either, the thread sleeps until a message arrives.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from engine.llm_engine import LLMEngine, StepStats
from engine.outputs import RequestOutput
from engine.recording import RecordSpec
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 1.0


class EngineObserver(Protocol):
    """Receives what the worker thread produces (called on that thread)."""

    def on_step(self, stats: StepStats) -> None: ...

    def on_output(self, output: RequestOutput) -> None: ...


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    record: RecordSpec | None = None


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observers: list[EngineObserver] | None = None,
                 idle_work: Callable[[], bool] | None = None):
        self.engine = engine
        self.observers = observers or []
        # called when the engine has nothing runnable; returns True if it did some work
        self.idle_work = idle_work
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        # seconds the engine had nothing runnable (training or waiting), for
        # alchemist:engine_idle_seconds_total: the share of idle time training harvests
        self.idle_seconds = 0.0

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="alchemist-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- the asyncio side -------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       record: RecordSpec | None = None) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs. Raises InvalidParameter before anything is queued
        if the request can never be served. Leaving the iteration early aborts it."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        self.engine.validate(prompt_token_ids, params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._send(_Add(request_id, list(prompt_token_ids), params, time.monotonic(), record))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._send(_Abort(request_id))
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def notify(self) -> None:
        """Wakes the worker: idle work may have become available (e.g. a label arrived)."""
        self._wake.set()

    def _send(self, message) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    # -- the worker thread ------------------------------------------------------------

    def _apply_messages(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Add):
                if message.request_id not in self._streams:
                    continue  # the caller left before its request reached the engine
                try:
                    self.engine.add_request(message.request_id, message.prompt_token_ids, message.params,
                                            message.arrival_time, message.record)
                except Exception as exc:  # noqa: BLE001 - reported to the caller
                    self._deliver(message.request_id, exc)
            elif isinstance(message, _Abort):
                output = self.engine.abort_request(message.request_id)
                if output is not None:
                    self._publish(output)

    def _publish(self, output: RequestOutput) -> None:
        for observer in self.observers:
            observer.on_output(output)
        self._deliver(output.request_id, output)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in self.engine.request_ids():
            output = self.engine.abort_request(request_id)
            if output is not None:
                output.error = f"{type(exc).__name__}: {exc}"
                self._publish(output)

    def _idle_work(self) -> bool:
        try:
            return self.idle_work()
        except Exception:  # noqa: BLE001 - idle work must never stop serving
            logger.exception("idle work failed")
            return False

    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            self._apply_messages()
            if self.engine.has_unfinished():
                try:
                    outputs, stats = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - the server keeps serving
                    logger.exception("engine step failed; failing the requests in it")
                    self._fail_all(exc)
                    continue
                self.num_steps += 1
                for observer in self.observers:
                    observer.on_step(stats)
                for output in outputs:
                    self._publish(output)
            else:
                idle_started = time.monotonic()
                worked = self.idle_work is not None and self._idle_work()
                if not worked:
                    # with idle work, wake up now and then: its own deadlines (label timeouts) come due
                    self._wake.wait(_IDLE_POLL_S if self.idle_work is not None else None)
                self.idle_seconds += time.monotonic() - idle_started
        self._fail_all(EngineDeadError("the server is shutting down"))
