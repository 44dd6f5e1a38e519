"""The arbiter: what runs on the device in the gaps between serving steps.

The async bridge (engine/async_engine.py) calls it as its idle hook (engine/hooks.py):

  - when nothing is runnable, one item of training work (`OnlineTraining.run_slice`:
    housekeeping between jobs, else a slice of the job) — policy `idle`, the paper's; a
    request that arrives meanwhile waits for at most that item;
  - with policy `slo`, also training slices between decode steps, while the measured time
    per output token stays under `tpot_slo_ms` (it backs off, doubling, when it does not);
  - under either policy, after a serving step: label expiry when it is due (under steady
    traffic no idle gap comes), the steps and rollbacks other data-parallel replicas
    combined this replica's gradients into (trainer/replicated.py; every replica applies
    them, idle or not), and a bounded piece of the rebuild of merged serving
    weights while they are stale, else of warming the heap for the next recording
    (trainer/maintenance.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from engine.hooks import DeviceGate
from engine.outputs import StepStats
from trainer.config import ArbiterConfig

logger = logging.getLogger(__name__)

# with training work, the loop wakes up now and then: its deadlines (label timeouts) come due
IDLE_POLL_S = 1.0
# smoothing of the measured step, slice and token times
_EMA = 0.2
# serving maintenance between steps: this share of a step's time, at least the minimum
_MAINTENANCE_SHARE = 0.3
_MAINTENANCE_MIN_S = 0.005


class ServingMaintenance(Protocol):
    """What must run between serving steps (trainer/maintenance.py)."""

    def expiry_due(self) -> bool: ...

    def expire(self) -> None: ...

    def merged_stale(self) -> bool:
        """Whether serving runs on stale merged weights (a cheap check, on the loop)."""
        ...

    def rebuild_merged(self, budget_s: float) -> bool:
        """Does about `budget_s` of the rebuild; False if there was none to do."""
        ...

    def warming_due(self) -> bool:
        """Whether the heap should be warmed for the next recording (a cheap check)."""
        ...

    def warm_heap(self, budget_s: float) -> bool:
        """Pre-faults heap pages for about `budget_s`; False if it was warm enough."""
        ...


class TrainingWork(Protocol):
    """What the arbiter schedules in the gaps (trainer/online.py)."""

    maintenance: ServingMaintenance

    def has_work(self) -> bool: ...

    def run_slice(self, serving_ran: bool = False) -> bool:
        """One bounded item of work; `serving_ran`: serving steps ran since the last."""
        ...

    def sync_due(self) -> bool:
        """(replicas) A combined step or rollback waits to be applied (a cheap check)."""
        ...

    def apply_synced(self) -> bool: ...


@dataclass
class ArbiterStats:
    # training slices run in true idle gaps, and between decode steps (slo policy)
    idle_slices: int = 0
    between_step_slices: int = 0
    # and their seconds (the idle ones are part of the engine's idle time; the others are not)
    idle_slice_seconds: float = 0.0
    between_step_slice_seconds: float = 0.0
    # times the slo policy stopped interleaving because the measured TPOT exceeded the SLO
    slo_backoffs: int = 0
    # serving-maintenance items run between serving steps: merged weights rebuilt; heap
    # pages pre-faulted for the next recording
    maintenance_slices: int = 0
    warming_slices: int = 0
    # smoothed measurements (seconds): serving step, training slice, time per output token
    step_ema: float = 0.0
    slice_ema: float = 0.0
    tpot_ema: float = 0.0


def _ema(old: float, new: float) -> float:
    return new if old == 0.0 else (1 - _EMA) * old + _EMA * new


class Arbiter:
    """The idle hook: `training` runs in the gaps `config.policy` allows."""

    def __init__(self, training: TrainingWork, config: ArbiterConfig | None = None):
        self.training = training
        self.config = config or ArbiterConfig()
        self.stats = ArbiterStats()
        self._backoff_steps = 0
        self._backoff_length = 1
        self._last_decode_done: float | None = None
        # serving steps ran since the last training item (a job in progress was preempted)
        self._serving_ran = False

    # -- IdleHook -------------------------------------------------------------------------

    def poll_seconds(self) -> float | None:
        return IDLE_POLL_S

    def on_serving_step(self, seconds: float, stats: StepStats, finished_at: float | None = None) -> None:
        done = time.perf_counter() if finished_at is None else finished_at
        self._serving_ran = True
        self.stats.step_ema = _ema(self.stats.step_ema, seconds)
        if stats.num_running and self._last_decode_done is not None:
            self.stats.tpot_ema = _ema(self.stats.tpot_ema, done - self._last_decode_done)
        self._last_decode_done = done if stats.num_running else None

    async def run_when_idle(self, device: DeviceGate) -> bool:
        # also when the trainer has no work: the slice expires old entries
        self._last_decode_done = None  # a gap in serving is not a token time
        worked, seconds = await device.run(self._slice_item)
        if worked:
            self.stats.idle_slices += 1
            self.stats.idle_slice_seconds += seconds
            self.stats.slice_ema = _ema(self.stats.slice_ema, seconds)
        return worked

    def wants_between_steps(self) -> bool:
        # the slo policy decides after every step (and counts its backoff in steps)
        maintenance = self.training.maintenance
        return (self.config.policy == "slo" or maintenance.expiry_due() or self.training.sync_due()
                or maintenance.merged_stale() or maintenance.warming_due())

    async def after_serving_step(self, device: DeviceGate) -> None:
        maintenance = self.training.maintenance
        if maintenance.expiry_due():  # label timeouts come due under steady traffic too
            await device.run(maintenance.expire)
        if self.training.sync_due():
            try:
                await device.run(self.training.apply_synced)
            except Exception:  # noqa: BLE001 - training must never stop serving (the replica leaves its group)
                logger.exception("applying the replicas' step failed")
        spent = await self._serving_maintenance(device)
        if self.config.policy == "slo":
            await self._slices_between_steps(device, spent)

    # -- the policies ---------------------------------------------------------------------

    def _slice_item(self) -> tuple[bool, float]:
        """One training slice, on the device thread; (worked, seconds)."""
        started = time.perf_counter()
        serving_ran, self._serving_ran = self._serving_ran, False
        try:
            worked = self.training.run_slice(serving_ran)
        except Exception:  # noqa: BLE001 - training must never stop serving
            logger.exception("training slice failed")
            worked = False
        return worked, time.perf_counter() - started

    async def _serving_maintenance(self, device: DeviceGate) -> float:
        """After an optimizer step the merged serving weights are stale and serving runs
        through the slower unmerged path until they are rebuilt. Waiting for an idle gap
        would leave a request that arrived meanwhile on that path for its whole life, so
        a bounded part of the rebuild (a fraction of a step) runs between serving steps.
        Otherwise, while prefills are recorded faster than idle gaps come (or through a
        pause in recording, as much as the trim slack), the same share of a step
        pre-faults heap pages for the next recording, which would else fault them in
        inside its prefill (its time to first token). Returns the seconds it took."""
        maintenance = self.training.maintenance
        if device.interrupted() or not device.serving():
            return 0.0
        merging = maintenance.merged_stale()
        if not merging and not maintenance.warming_due():
            return 0.0  # no executor round trip after the steps where nothing is due
        budget = max(_MAINTENANCE_MIN_S, _MAINTENANCE_SHARE * self.stats.step_ema)
        started = time.perf_counter()
        if not await device.run(maintenance.rebuild_merged if merging else maintenance.warm_heap, budget):
            return 0.0
        if merging:
            self.stats.maintenance_slices += 1
        else:
            self.stats.warming_slices += 1
        return time.perf_counter() - started

    async def _slices_between_steps(self, device: DeviceGate, spent: float = 0.0) -> None:
        """slo policy: training slices after a decode step, within the token-time budget
        (`spent`: what serving maintenance already took of it after this step)."""
        if not device.serving() or device.interrupted():
            return
        slo = self.config.tpot_slo_ms / 1000.0
        if self.stats.tpot_ema > slo:
            self.stats.slo_backoffs += 1
            self._backoff_steps = self._backoff_length
            self._backoff_length = min(self._backoff_length * 2, 64)
            return
        if self._backoff_steps > 0:
            self._backoff_steps -= 1
            return
        self._backoff_length = max(1, self._backoff_length // 2)
        while (self.training.has_work() and not device.interrupted()
               and self.stats.step_ema + spent + max(self.stats.slice_ema, 1e-4) <= slo):
            worked, seconds = await device.run(self._slice_item)
            if not worked:
                return
            spent += seconds
            self.stats.between_step_slices += 1
            self.stats.between_step_slice_seconds += seconds
            self.stats.slice_ema = _ema(self.stats.slice_ema, seconds)
