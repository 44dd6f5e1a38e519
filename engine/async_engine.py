"""The engine behind the asyncio server: one device executor, and the arbiter.

All tensor work — engine steps, training slices, optimizer steps — runs on one worker
thread, one item at a time (the device executor). The asyncio loop never runs tensor
code: it enqueues messages (add, abort), awaits per-request queues, and runs the
arbiter, a coroutine that chooses the executor's next item:

  - an engine step whenever a request is runnable; messages are applied at the step
    boundary, so a new or aborted request (a client that disconnected) takes effect
    within one engine step, and a request that arrives during training waits for at most
    the slice in progress;
  - a training slice (`TrainingWork.run_slice`) when nothing is runnable — policy `idle`,
    the paper's — or, with policy `slo`, also between decode steps while the measured
    time per output token stays under `tpot_slo_ms` (it backs off when it does not);
  - under either policy, a bounded piece of serving maintenance after a serving step
    while the merged serving weights are stale (`run_serving_maintenance`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

from trainer.config import ArbiterConfig
from engine.llm_engine import LLMEngine, StepStats
from engine.outputs import RequestOutput
from engine.recording import RecordSpec
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# with training work, the arbiter wakes up now and then: its deadlines (label timeouts) come due
_IDLE_POLL_S = 1.0
# smoothing of the measured step, slice and token times
_EMA = 0.2
# serving maintenance between steps: this share of a step's time, at least the minimum
_MAINTENANCE_SHARE = 0.3
_MAINTENANCE_MIN_S = 0.005


class EngineObserver(Protocol):
    """Receives what the engine produces (called on the asyncio loop's thread)."""

    def on_step(self, stats: StepStats) -> None: ...

    def on_output(self, output: RequestOutput) -> None: ...


class TrainingWork(Protocol):
    """What the arbiter schedules in the gaps (the trainer)."""

    def has_work(self) -> bool: ...

    def run_slice(self) -> bool: ...

    def serving_maintenance_pending(self) -> bool:
        """Whether there is work that makes serving itself faster (rebuilding merged
        serving weights after an optimizer step); a cheap check, on the asyncio loop."""
        ...

    def run_serving_maintenance(self, budget_s: float) -> bool:
        """Does about `budget_s` of that work, between serving steps under any policy;
        False if there was none."""
        ...


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


@dataclass
class ArbiterStats:
    # training slices run in true idle gaps, and between decode steps (slo policy)
    idle_slices: int = 0
    between_step_slices: int = 0
    # times the slo policy stopped interleaving because the measured TPOT exceeded the SLO
    slo_backoffs: int = 0
    # serving-maintenance items run between serving steps (merged weights rebuilt)
    maintenance_slices: int = 0
    # seconds the engine had nothing runnable (spent training or waiting)
    idle_seconds: float = 0.0
    # smoothed measurements (seconds): decode step, training slice, time per output token
    step_ema: float = 0.0
    slice_ema: float = 0.0
    tpot_ema: float = 0.0


def _ema(old: float, new: float) -> float:
    return new if old == 0.0 else (1 - _EMA) * old + _EMA * new


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observers: list[EngineObserver] | None = None,
                 training: TrainingWork | None = None, arbiter: ArbiterConfig | None = None):
        self.engine = engine
        self.observers = observers or []
        self.training = training
        self.arbiter_config = arbiter or ArbiterConfig()
        self.stats = ArbiterStats()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._inbox: collections.deque = collections.deque()
        self._wake: asyncio.Event | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._stopping = False
        self._backoff_steps = 0
        self._backoff_length = 1
        self._last_decode_done: float | None = None

    # -- lifecycle (on the asyncio loop) ----------------------------------------------

    def start(self) -> None:
        """Starts the executor thread and the arbiter; call from inside the running loop."""
        if self._task is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="alchemist-device")
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._arbitrate(), name="alchemist-arbiter")

    async def stop(self) -> None:
        """Stops admitting work; the item in progress (a step or a slice) finishes, a
        training job in progress is parked, and requests still running get an error."""
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    @property
    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done() and not self._stopping

    # -- requests (on the asyncio loop) -----------------------------------------------

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
        self._streams[request_id] = stream
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

    async def run_on_device(self, fn, *args):
        """Runs `fn(*args)` on the device thread, after the item in progress (adapter
        rollback: weights must not change under a step or a slice)."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        return await self._run(fn, *args)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def notify(self) -> None:
        """Wakes the arbiter: training work may have become available (a label arrived)."""
        if self._wake is not None:
            self._wake.set()

    def _send(self, message) -> None:
        self._inbox.append(message)
        if self._wake is not None:
            self._wake.set()

    def _publish(self, output: RequestOutput) -> None:
        for observer in self.observers:
            observer.on_output(output)
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put_nowait(output)

    # -- executor items (on the device thread) ----------------------------------------

    def _engine_item(self, messages: list):
        """Applies messages at this step boundary, then runs one step if anything is runnable."""
        outputs, errors = [], []
        for message in messages:
            if isinstance(message, _Add):
                try:
                    self.engine.add_request(message.request_id, message.prompt_token_ids, message.params,
                                            message.arrival_time, message.record)
                except Exception as exc:  # noqa: BLE001 - reported to the caller
                    errors.append((message.request_id, exc))
            else:
                output = self.engine.abort_request(message.request_id)
                if output is not None:
                    outputs.append(output)
        stats = None
        if self.engine.has_unfinished():
            try:
                step_outputs, stats = self.engine.step()
                outputs.extend(step_outputs)
            except Exception as exc:  # noqa: BLE001 - the server keeps serving
                logger.exception("engine step failed; failing the requests in it")
                outputs.extend(self._fail_all(exc))
        return outputs, errors, stats

    def _fail_all(self, exc: BaseException) -> list[RequestOutput]:
        failed = []
        for request_id in self.engine.request_ids():
            output = self.engine.abort_request(request_id)
            if output is not None:
                output.error = f"{type(exc).__name__}: {exc}"
                failed.append(output)
        return failed

    def _slice_item(self) -> tuple[bool, float]:
        started = time.perf_counter()
        try:
            worked = self.training.run_slice()
        except Exception:  # noqa: BLE001 - training must never stop serving
            logger.exception("training slice failed")
            worked = False
        return worked, time.perf_counter() - started

    # -- the arbiter (a coroutine on the asyncio loop) --------------------------------

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _arbitrate(self) -> None:
        while not self._stopping:
            self._wake.clear()
            if self._inbox or self.engine.has_unfinished():
                await self._serve_step()
                maintenance_s = await self._serving_maintenance()
                if self.arbiter_config.policy == "slo":
                    await self._slices_between_steps(maintenance_s)
                continue
            idle_started = time.monotonic()
            worked = False
            if self.training is not None:  # also when it has no work: the slice expires old entries
                worked, seconds = await self._run(self._slice_item)
                if worked:
                    self.stats.idle_slices += 1
                    self.stats.slice_ema = _ema(self.stats.slice_ema, seconds)
            if not worked:
                timeout = _IDLE_POLL_S if self.training is not None else None
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
            self.stats.idle_seconds += time.monotonic() - idle_started
            self._last_decode_done = None  # a gap in serving is not a token time
        self._inbox.clear()
        for output in await self._run(self._fail_all, EngineDeadError("the server is shutting down")):
            self._publish(output)

    async def _serve_step(self) -> None:
        messages = list(self._inbox)
        self._inbox.clear()
        started = time.perf_counter()
        outputs, errors, stats = await self._run(self._engine_item, messages)
        done = time.perf_counter()
        for request_id, exc in errors:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(exc)
        if stats is not None:
            for observer in self.observers:
                observer.on_step(stats)
            self.stats.step_ema = _ema(self.stats.step_ema, done - started)
            if stats.num_running and self._last_decode_done is not None:
                tpot = done - self._last_decode_done
                self.stats.tpot_ema = _ema(self.stats.tpot_ema, tpot)
            self._last_decode_done = done if stats.num_running else None
        for output in outputs:
            self._publish(output)

    async def _serving_maintenance(self) -> float:
        """After an optimizer step the merged serving weights are stale and serving runs
        through the slower unmerged path until they are rebuilt. Waiting for an idle gap
        would leave a request that arrived meanwhile on that path for its whole life, so
        a bounded part of the rebuild (a fraction of a step) runs between serving steps.
        Returns the seconds it took."""
        if (self.training is None or self._inbox or not self.engine.has_unfinished()
                or not self.training.serving_maintenance_pending()):
            return 0.0  # no executor round trip after the steps where nothing is stale
        budget = max(_MAINTENANCE_MIN_S, _MAINTENANCE_SHARE * self.stats.step_ema)
        started = time.perf_counter()
        if not await self._run(self.training.run_serving_maintenance, budget):
            return 0.0
        self.stats.maintenance_slices += 1
        return time.perf_counter() - started

    async def _slices_between_steps(self, spent: float = 0.0) -> None:
        """slo policy: training slices after a decode step, within the token-time budget
        (`spent`: what serving maintenance already took of it after this step)."""
        if self.training is None or not self.engine.has_unfinished() or self._inbox:
            return
        slo = self.arbiter_config.tpot_slo_ms / 1000.0
        if self.stats.tpot_ema > slo:
            self.stats.slo_backoffs += 1
            self._backoff_steps = self._backoff_length
            self._backoff_length = min(self._backoff_length * 2, 64)
            return
        if self._backoff_steps > 0:
            self._backoff_steps -= 1
            return
        self._backoff_length = max(1, self._backoff_length // 2)
        while (self.training.has_work() and not self._inbox and not self._stopping
               and self.stats.step_ema + spent + max(self.stats.slice_ema, 1e-4) <= slo):
            worked, seconds = await self._run(self._slice_item)
            if not worked:
                return
            spent += seconds
            self.stats.between_step_slices += 1
            self.stats.slice_ema = _ema(self.stats.slice_ema, seconds)
