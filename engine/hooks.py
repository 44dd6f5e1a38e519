"""The engine's seams: the small protocols through which other packages plug in.

The engine imports nothing from `trainer/`, `offload/`, `server/` or `bench/`; the
composition root (server/build.py) hands it objects that satisfy these protocols, at
construction: `EngineHooks` to `LLMEngine`, an `IdleHook` to `AsyncEngine`. All of them
are called on the device thread, except `IdleHook`, which the async bridge calls on the
asyncio loop and which sends its tensor work to the device thread through `DeviceGate`,
and `PrefillRecorder.answer_written`, which the bridge asks on the loop. `Wakeup` lets
other threads wake the bridge's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol, TypeVar

from engine.outputs import RequestOutput, StepStats
from engine.recording import RecordedPrefill, RecordSpec, SegmentSink

T = TypeVar("T")


class PrefillRecorder(Protocol):
    """Decides which prefills are recorded and receives the recordings (the trainer)."""

    # trainable requests track their sampled tokens' log-probs even when not recorded
    # (their labels train by recomputation and use the served values)
    wants_served_logprobs: bool

    def logprob_temperature(self, sampling_temperature: float, num_choices: int) -> float:
        """The temperature a trainable request of `num_choices` choices sampled at
        `sampling_temperature` tracks its tokens' log-probs at (engine/sampler.py): 1 for the
        model's own distribution."""
        ...

    def expect(self, request_id: str, expected: bool = True) -> None:
        """A request the client allows training on was made (before its first byte is
        sent): until it is admitted or finishes, feedback for it is answered as for one
        being generated; `expected=False`: it never ran (refused, or aborted before it was queued)."""
        ...

    def admit(self, request_id: str, prompt_token_ids: list[int], num_choices: int = 1,
              client_prompt: object = None, logprob_temperature: float = 1.0,
              num_cached_tokens: int = 0) -> RecordSpec | None:
        """Asked once per trainable request, when its prefill is about to be scheduled:
        how to record it, stamped with the adapter version serving runs under, or None.
        `num_choices`: the request's n (its choices share the one recording);
        `client_prompt`: the request's `EngineRequest.client_prompt`; `logprob_temperature`:
        what its tracked log-probs are taken at (`logprob_temperature`'s answer);
        `num_cached_tokens`: the prompt's beginning the prefix cache holds now (a recording
        that reads it records only the rest)."""
        ...

    def confirm(self, request_id: str, prompt_token_ids: list[int], spec: RecordSpec,
                num_cached_tokens: int = 0) -> RecordSpec | None:
        """Asked each time an admitted recording's prefill is about to be scheduled: `spec`
        if it still holds (the weights serving runs under are still its version, and what
        it would record after the `num_cached_tokens` the prefix cache holds now is within
        bounds), else None — the prefill then runs unrecorded."""
        ...

    def on_recorded(self, request_id: str, recording: RecordedPrefill) -> None: ...

    def answer_written(self, request_id: str) -> concurrent.futures.Future | None:
        """Asked on the asyncio loop when a request has finished: the write of its answer
        that its label will look for (the feedback ledger), while on its way, or None. The
        async bridge holds the request's last output until it is done (bounded), so that a
        request answered before a crash still takes its label after the restart."""
        ...


class StepMemoryGuard(Protocol):
    """Makes room on the device before each serving step (the activation offloader)."""

    def before_step(self, num_tokens: int, batch_size: int, recorded_tokens: int = 0) -> None: ...

    def after_step(self) -> None: ...


class EngineObserver(Protocol):
    """Receives what the engine produces, on the device thread (metrics, the trainer)."""

    def on_step(self, stats: StepStats) -> None: ...

    def on_output(self, output: RequestOutput) -> None: ...


@dataclass(frozen=True)
class EngineHooks:
    """What plugs into the engine; every field is optional (serving alone needs none)."""

    # decides which prefills are recorded and receives the recordings (the trainer's recorder)
    recorder: PrefillRecorder | None = None
    # makes room on the device before each step (the activation offloader)
    memory_guard: StepMemoryGuard | None = None
    # receives each recorded layer segment as it completes (the activation offloader)
    segment_sink: SegmentSink | None = None
    # resolves weights changed since a recording was made (the trainer's weight stash;
    # engine.recording.SavedTensorTracker.resolve_stale)
    stale_resolver: Callable | None = None
    # the LoRA weights a prefill recorded under adapter version v runs with: a context
    # manager (the trainer's: v's stashed weights while the eval gate keeps serving on the
    # promoted version); None: the live weights
    recording_weights: Callable[[int], contextlib.AbstractContextManager] | None = None
    # which weights serving runs with: a number that changes whenever they do (the trainer's,
    # trainer/maintenance.py), so that the prefix cache never hands K/V computed under other
    # weights to a prompt; None: the weights never change
    weights_generation: Callable[[], int] | None = None
    # receive every step's stats and outputs (metrics, the recorder)
    observers: tuple[EngineObserver, ...] = field(default_factory=tuple)


class DeviceGate(Protocol):
    """What an idle hook may use of the async bridge (engine/async_engine.py)."""

    def run(self, fn: Callable[..., T], *args) -> Awaitable[T]:
        """Runs `fn(*args)` on the device thread, after the item in progress."""
        ...

    def interrupted(self) -> bool:
        """A message (a new request, an abort, shutdown) waits: hand the device back."""
        ...

    def serving(self) -> bool:
        """Requests are running or waiting."""
        ...


class IdleHook(Protocol):
    """Decides what runs in the gaps between serving steps (the arbiter, trainer/arbiter.py);
    the shape of mini-sglang's `run_when_idle`. Called on the asyncio loop, except
    `wants_between_steps`."""

    def on_serving_step(self, seconds: float, stats: StepStats, finished_at: float | None = None) -> None:
        """A serving step took `seconds` of the device's time and ended at `finished_at`
        (`time.perf_counter()`; None: just now) — measurements only."""
        ...

    def wants_between_steps(self) -> bool:
        """Whether `after_serving_step` has work after this step; asked on the device
        thread after each serving step (a cheap check). False lets the next step follow
        at once, without a round trip through the loop."""
        ...

    async def after_serving_step(self, device: DeviceGate) -> None:
        """Between two serving steps: bounded work that may run while requests do."""
        ...

    async def run_when_idle(self, device: DeviceGate) -> bool:
        """Nothing is runnable: one item of work; False if there was none."""
        ...

    def poll_seconds(self) -> float | None:
        """How long the bridge may sleep with nothing to do before asking again
        (deadlines such as label timeouts come due); None: until a message arrives."""
        ...


class Wakeup:
    """Wakes the bridge's loop from any thread: idle work became available (a reward
    function's result). Made before the bridge, so that parts built earlier can hold it;
    it does nothing until the bridge starts."""

    def __init__(self):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._notify = None

    def bind(self, loop: asyncio.AbstractEventLoop, notify) -> None:
        self._loop, self._notify = loop, notify

    def __call__(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._notify)
