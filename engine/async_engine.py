"""The bridge between the asyncio server and the engine: an inbox, per-request streams,
and one device executor.

All tensor work — engine steps, aborts' cleanup, training slices, optimizer steps,
releases — runs on one worker thread, one item at a time (the device executor). The
asyncio loop never runs tensor code: it queues messages (add, abort, shutdown), awaits
per-request queues, and runs the loop below, which submits the executor's next item:

  - an engine step whenever a request is runnable or a message waits; messages are
    applied at the step boundary, so a new or aborted request (a client that
    disconnected) takes effect within one engine step. While requests run and nothing
    else is due between steps (no device item waiting, nothing the idle hook must run),
    the device thread goes on to the next step itself and hands each step's outputs to
    the loop as they come: the step cadence does not wait on a busy event loop;
  - otherwise, whatever the idle hook (the arbiter, trainer/arbiter.py) chooses to run
    in the gap, and after each serving step, what it chooses to run between steps.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

import torch

from engine.grammar_limits import on_compile_threads
from engine.hooks import IdleHook, Wakeup
from engine.llm_engine import LLMEngine
from engine.outputs import EngineError, ErrorKind, RequestOutput, StepStats, merged
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# how long a finished request's answer waits for the recorder's write of it (the feedback ledger's commit)
ANSWER_WRITE_WAIT_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine is not running (not started, stopped, or shutting down)."""


@dataclass
class _Add:
    request: EngineRequest


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Shutdown:
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_hook: IdleHook | None = None, wakeup: Wakeup | None = None,
                 async_output: bool = False):
        """`wakeup`: how other threads wake the loop (see `Wakeup`). `async_output`: a chained
        step's outputs reach the loop once the next step's device work is queued (see
        `_serving_steps`); for a GPU, where the host waits for the device."""
        self.engine = engine
        self.async_output = async_output
        self.idle_hook = idle_hook
        self.wakeup = wakeup or Wakeup()
        # (idle seconds before, when the current idle spell began or None): replaced whole, never seen going back
        self._idle: tuple[float, float | None] = (0.0, None)
        # serving steps, and the device's seconds between consecutive ones while requests were
        # running: the round trip through the event loop, and what the idle hook ran between steps
        self.serving_steps = 0
        self.step_gap_seconds = 0.0
        self._last_step_end: float | None = None
        # device items submitted and cancelled before they began (on the loop), and begun
        # (on the device thread): one waiting ends a chain of serving steps
        self._items_submitted = 0
        self._items_cancelled = 0
        self._items_begun = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        # native ids of the event loop's thread and of the device thread (engine/thread_cpu.py)
        self.thread_ids: dict[str, int] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._inbox: collections.deque = collections.deque()
        self._wake: asyncio.Event | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._stopping = False

    # -- lifecycle (on the asyncio loop) ----------------------------------------------

    def start(self) -> None:
        """Starts the executor thread and the loop; call from inside the running loop."""
        if self._task is None:
            self.thread_ids["event_loop"] = threading.get_native_id()
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="alchemist-device",
                                                                   initializer=self._device_thread_started)
            self._wake = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            self.wakeup.bind(self._loop, self.notify)
            self._task = asyncio.get_running_loop().create_task(self._run_loop(), name="alchemist-engine")

    def _device_thread_started(self) -> None:
        self.thread_ids["device"] = threading.get_native_id()
        device = self.engine.runner.device
        if device.type == "cuda":
            # a new thread's current CUDA device is cuda:0, whatever the process set: a
            # replica on cuda:N makes it its thread's
            torch.cuda.set_device(device)

    async def stop(self) -> None:
        """Sends the shutdown message: the item in progress (a step or a slice) finishes,
        the idle hook runs no further slice (a training job in progress stays unfinished),
        and requests still running get an error."""
        self._stopping = True
        self._send(_Shutdown())
        if self._task is not None:
            await self._task
            self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    @property
    def vocab_size(self) -> int:
        """Token ids this engine accepts are in [0, vocab_size)."""
        return self.engine.vocab_size

    @property
    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done() and not self._stopping

    # -- requests (on the asyncio loop) -----------------------------------------------

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, train: bool = False,
                     client_prompt: object = None, matcher=None, cache_salt: str | None = None) -> EngineRequest:
        """Validates a request (no tensor work); raises InvalidParameter. `matcher`: `check_grammar`'s."""
        return self.engine.make_request(request_id, prompt_token_ids, params, time.monotonic(), train,
                                        client_prompt, matcher, cache_salt)

    async def check_grammar(self, params: SamplingParams):
        """Its grammar's matcher (or None), compiled off the loop: 60,000 choices held it 3 s."""
        return await on_compile_threads(self.engine.grammars.check, params.grammar) if params.grammar else None

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs (those that queued up while the caller was busy
        come merged into one; the last once the recorder has written its answer, as
        `_answer_written` waits). Leaving the iteration early aborts it."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = stream
        self._send(_Add(request))
        finished = False
        pending = None  # an error met while merging: it comes after what came before it
        try:
            while not finished:
                item = pending if pending is not None else await stream.get()
                pending = None
                if isinstance(item, BaseException):
                    raise item
                # a consumer that fell behind the engine (a busy event loop) takes what
                # queued up as one output: one chunk to encode and send, not one per step
                while not item.finished and not stream.empty():
                    later = stream.get_nowait()
                    if isinstance(later, BaseException) or later.error is not None:
                        pending = later  # after what came before it, which is sent first
                        break
                    item = merged(item, later)
                finished = item.finished
                if finished and item.error is None:
                    await self._answer_written(request.request_id)
                yield item
        finally:
            if not finished:
                self.abort(request.request_id)
            self._streams.pop(request.request_id, None)

    async def _answer_written(self, request_id: str) -> None:
        """Waits, at most ANSWER_WRITE_WAIT_S, for the recorder to have written a finished
        request's answer where its label will look for it (hooks.PrefillRecorder.answer_written)."""
        recorder = self.engine.hooks.recorder
        written = recorder.answer_written(request_id) if recorder is not None else None
        if written is not None and not written.done():
            with contextlib.suppress(asyncio.TimeoutError):  # (shielded: giving up must not cancel the write)
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(written)), ANSWER_WRITE_WAIT_S)

    async def run_on_device(self, fn, *args):
        """Runs `fn(*args)` on the device thread, after the item in progress (adapter
        rollback: weights must not change under a step or a slice)."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        return await self.run(fn, *args)

    def abort(self, request_id: str) -> None:
        """Stops a request at the next step boundary (its stream gets its final output)."""
        self._send(_Abort(request_id))

    def notify(self) -> None:
        """Wakes the loop: idle work may have become available (a label arrived)."""
        if self._wake is not None:
            self._wake.set()

    def _send(self, message) -> None:
        self._inbox.append(message)
        if self._wake is not None:
            self._wake.set()

    def _publish(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put_nowait(output)

    # -- DeviceGate (engine/hooks.py), for the idle hook --------------------------------

    async def run(self, fn, *args):
        def item():
            self._items_begun += 1
            return fn(*args)

        self._items_submitted += 1
        future = self._executor.submit(item)
        future.add_done_callback(self._count_cancelled)
        return await asyncio.wrap_future(future)

    def _count_cancelled(self, future: concurrent.futures.Future) -> None:
        """A caller cancelled before its item began (the item never runs): it waits no more."""
        if future.cancelled():
            self._items_cancelled += 1

    def interrupted(self) -> bool:
        return bool(self._inbox) or self._stopping

    def serving(self) -> bool:
        return self.engine.has_unfinished()

    # -- executor items (on the device thread) ----------------------------------------

    def _engine_item(self, messages: list) -> tuple[list[RequestOutput], list, StepStats | None]:
        """Applies messages at this step boundary, then runs one step if anything is runnable."""
        outputs, errors = [], []
        for message in messages:
            if isinstance(message, _Add):
                try:
                    self.engine.add(message.request)
                except Exception as exc:  # noqa: BLE001 - reported to the caller
                    self.engine.expect(message.request, expected=False)
                    errors.append((message.request.request_id, exc))
            elif isinstance(message, _Abort):
                output = self.engine.abort_request(message.request_id)
                if output is not None:
                    outputs.append(output)
        stats = None
        if self.engine.has_unfinished():
            started = time.perf_counter()
            if self._last_step_end is not None:
                self.step_gap_seconds += started - self._last_step_end
            try:
                step_outputs, stats = self.engine.step()
                outputs.extend(step_outputs)
            except Exception as exc:  # noqa: BLE001 - the server keeps serving
                logger.exception("engine step failed; failing the requests in it")
                outputs.extend(self._fail_all(EngineError(ErrorKind.STEP_FAILED, f"{type(exc).__name__}: {exc}")))
            self.serving_steps += 1
        self._last_step_end = time.perf_counter() if self.engine.has_unfinished() else None
        return outputs, errors, stats

    def _serving_steps(self, messages: list) -> tuple[list[RequestOutput], list, StepStats | None, float]:
        """Serving steps back to back while nothing else is due between them: no round
        trip through the event loop from one step to the next. Each step's results but the
        last go to the loop as they come (`_deliver`); the last's are returned, with its
        seconds. New requests and aborts join at the next step boundary, as before.

        With `async_output`, a step's results go to the loop once the next step's device
        work is queued, just before it waits for the device (`LLMEngine.before_next_read_back`).
        Sent at once, they wake the loop as the next step begins: its per-token work (SSE,
        JSON, sockets) holds the GIL that the step's launches need, and the step waits for
        it. Sent then, that work runs while the device computes. The cost: each token
        reaches its stream the next step's host part later."""
        previous = None  # the step before's results, waiting for this step's device work
        while True:
            if previous is not None:
                self.engine.before_next_read_back(functools.partial(self._deliver_soon, previous))
            started = time.perf_counter()
            try:
                outputs, errors, stats = self._engine_item(messages)
            finally:
                if previous is not None and self.engine.before_next_read_back(None) is not None:
                    self._deliver_soon(previous)  # the step read nothing back: they go now, still first
            seconds = time.perf_counter() - started
            results, previous = (outputs, errors, stats, seconds, time.perf_counter()), None
            if not self._next_step_follows(stats):
                return outputs, errors, stats, seconds
            if self.async_output:
                previous = results
            else:
                self._deliver_soon(results)
            messages = self._take_messages()

    def _deliver_soon(self, results: tuple) -> None:
        """From the device thread: `_deliver(*results)` on the loop, after what it was given before."""
        self._loop.call_soon_threadsafe(self._deliver, *results)

    def _next_step_follows(self, stats: StepStats | None) -> bool:
        """Whether another serving step runs at once: requests are running, and neither
        shutdown, a device item (`run`), nor the idle hook's between-steps work waits."""
        waiting = self._items_submitted - self._items_cancelled - self._items_begun
        if stats is None or not stats.num_scheduled_tokens or self._stopping or waiting \
                or not self.engine.has_unfinished():
            return False
        wants_between_steps = getattr(self.idle_hook, "wants_between_steps", None)
        try:
            return self.idle_hook is None or (wants_between_steps is not None and not wants_between_steps())
        except Exception:  # noqa: BLE001 - the loop's after_serving_step runs instead, as before
            logger.exception("the idle hook's between-steps check failed")
            return False

    def _take_messages(self) -> list:
        messages = []
        while self._inbox:
            message = self._inbox.popleft()
            if not isinstance(message, _Shutdown):
                messages.append(message)
        return messages

    def _fail_all(self, error: EngineError) -> list[RequestOutput]:
        failed = []
        for request_id in self.engine.request_ids():
            output = self.engine.abort_request(request_id)
            if output is not None:
                output.error = error
                failed.append(output)
        return failed

    @property
    def idle_seconds(self) -> float:
        """Seconds the engine had nothing runnable (spent in the idle hook or waiting), the
        current idle spell included (any thread)."""
        total, since = self._idle
        return total if since is None else total + time.monotonic() - since

    # -- the loop (a coroutine on the asyncio loop) -----------------------------------

    async def _run_loop(self) -> None:
        hook = self.idle_hook
        while not self._stopping:
            self._wake.clear()
            if self._inbox or self.engine.has_unfinished():
                stats = await self._serve_step()
                if hook is not None and stats is not None:
                    await hook.after_serving_step(self)
                continue
            idle_started = time.monotonic()
            self._idle = (self._idle[0], idle_started)
            worked = hook is not None and await hook.run_when_idle(self)
            if not worked:
                try:
                    await asyncio.wait_for(self._wake.wait(), hook.poll_seconds() if hook is not None else None)
                except asyncio.TimeoutError:
                    pass
            self._idle = (self._idle[0] + time.monotonic() - idle_started, None)
        for message in self._take_messages():  # added after the last step: never reached the engine
            stream = self._streams.get(message.request.request_id) if isinstance(message, _Add) else None
            if stream is not None:
                stream.put_nowait(EngineDeadError("the server is shutting down or restarting; retry the request"))
        stopped = EngineError(ErrorKind.ENGINE_STOPPED, "the server is shutting down")
        for output in await self.run(self._fail_all, stopped):
            self._publish(output)

    async def _serve_step(self) -> StepStats | None:
        """One or more serving steps (`_serving_steps`); the last one's stats."""
        outputs, errors, stats, seconds = await self.run(self._serving_steps, self._take_messages())
        self._deliver(outputs, errors, stats, seconds)
        return stats

    def _deliver(self, outputs: list[RequestOutput], errors: list, stats: StepStats | None, seconds: float,
                 finished_at: float | None = None) -> None:
        """On the loop: a step's results to their streams, then its time (and when it
        ended, `perf_counter`; by default now) to the idle hook."""
        for request_id, exc in errors:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(exc)
        for output in outputs:
            self._publish(output)
        if stats is not None and self.idle_hook is not None:
            try:
                self.idle_hook.on_serving_step(seconds, stats, finished_at)
            except Exception:  # noqa: BLE001 - measurements only: serving goes on
                logger.exception("the idle hook's step measurement failed")
