"""The job runner: trains the LoRA adapter in bounded slices, between serving steps.

`run_slice()` is called on the device thread by the arbiter (trainer/arbiter.py); each
call does one bounded slice of the current job (a layer's forward or backward, a loss,
or the optimizer step), so a newly arrived request waits for at most one slice. A job is
one optimizer step over the ready entries the activation cache (trainer/cache.py), which
owns their states, hands out: the recordings of one adapter version (a cohort, up to
`cohort_max_entries`: none goes stale waiting for another's step), or up to
`entries_per_step` entries trained by recomputation. A step over more than
`entries_per_step` entries is applied as one AdamW update per `entries_per_step` of
them. What is recorded is the recorder's (trainer/recorder.py); labels come in through
`FeedbackIntake` (trainer/intake.py); housekeeping between jobs is `Maintenance`'s
(trainer/maintenance.py); what becomes of a new version (merged weights, checkpoints) is
`AdapterLifecycle`'s (trainer/lifecycle.py).

Adapter versions: every optimizer step bumps the version. An entry recorded under an
older version `v`, at most `max_staleness` versions ago, trains on its recording (path
"stashed"): with `stale_weights = "stashed"`, under θ_v's weights from the stash
(trainer/stash.py), its gradient exactly ∇L(θ_v), applied to the current weights; with
"live" (the default), its recorded graph's LoRA weights re-aimed at today's
(`WeightStash.aim_at_live`: the recording's activations, today's LoRA products). An older
one is never back-propagated: it goes to the recompute path, or is dropped
(`stale_policy`), and `stale_entries` counts it.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field

from offload.offloader import ActivationOffloader
from trainer.cache import ActivationCache
from trainer.entries import CacheEntry, EntryState
from trainer.config import TrainConfig
from trainer.lifecycle import AdapterLifecycle
from trainer.methods import JobResult, TrainContext, TrainingMethod
from trainer.optimizer import AdapterOptimizer
from trainer.replica_messages import CombinedStep
from trainer.replicated import ReplicaSync
from trainer.stash import WeightStash
from trainer.status import TrainingStats

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    entries: list[CacheEntry]
    # a cohort (recordings of one version, up to cohort_max_entries), or entries trained by
    # recomputation (up to entries_per_step)
    cohort: bool
    # the generator of the entry being worked on, and which path it takes
    current: object = None
    path: str = ""
    # the adapter version whose stashed weights its slices run with (path "stashed")
    stashed_version: int | None = None
    # (stale_weights "live") the version whose copies may hold gradients when the entry ends
    collect_from: int | None = None
    # versions the entry being worked on lagged when it started, and each finished one's
    lag: int = 0
    lags: list[int] = field(default_factory=list)
    index: int = 0
    results: list[JobResult] = field(default_factory=list)
    # the path each finished entry took, in order and by completion id
    paths: list[str] = field(default_factory=list)
    path_of: dict[str, str] = field(default_factory=dict)
    # each finished entry's loss was finite, by completion id
    finite_of: dict[str, bool] = field(default_factory=dict)
    # (replicas) its gradients went to a round; it ends when that round's step applies
    contributed: bool = False


class Trainer:
    def __init__(self, config: TrainConfig, method: TrainingMethod, context: TrainContext,
                 optimizer: AdapterOptimizer, cache: ActivationCache, stats: TrainingStats, stash: WeightStash,
                 lifecycle: AdapterLifecycle, offloader: ActivationOffloader | None = None,
                 replicas: ReplicaSync | None = None):
        """`context`: what a method's jobs run on (the runner, the PEFT model, the
        offloader); `stash`: past versions' weights, for recordings up to `max_staleness`
        versions old; `lifecycle`: told of every optimizer step; `offloader`: the
        activation offloader, when a device budget is set; `replicas`: with data-parallel
        replicas, where a job's gradients go instead of the optimizer (trainer/replicated.py)."""
        self.config = config
        self.method = method
        self.mode = method.name
        self.context = context
        self.optimizer = optimizer
        self.cache = cache
        self.stats = stats
        self.stash = stash
        self.lifecycle = lifecycle
        self.offloader = offloader
        self.replicas = replicas
        self._job: _Job | None = None
        # what the last slice ran (the arbiter's figures name the longest one)
        self.slice_item = ""

    def in_job(self) -> bool:
        return self._job is not None

    def computing(self) -> bool:
        """A job is between its first slice and its gradients' hand-off: the weights must
        not change under it."""
        return self._job is not None and not self._job.contributed

    def has_work(self) -> bool:
        if self._job is not None:
            return not self._job.contributed
        return self._may_start() and self.cache.count(EntryState.READY) > 0

    def _may_start(self) -> bool:
        """A new job may start: always, unless the replicas' rounds stopped (its gradients
        would have nowhere to go until the group restarts)."""
        return self.replicas is None or self.replicas.stopped is None

    def run_slice(self) -> bool:
        """One bounded slice of the current job, or the start of the next; False if no
        entry is ready."""
        if self._job is not None and self._job.contributed:
            return False  # waiting for its round (trainer/replicated.py)
        if self._job is None:
            if not self._may_start():
                return False
            entries = self.cache.take_ready(self.config.entries_per_step, self.optimizer.version,
                                            self._staleness_bound(), self.config.cohort_max_entries)
            if not entries:
                return False
            self._job = _Job(entries, cohort=any(e.recording is not None for e in entries))
        job = self._job
        self.slice_item = f"{self.mode} job"
        try:
            if job.current is None:
                if job.index == len(job.entries) and not self._take_late_entries(job):
                    self.slice_item = "optimizer step"
                    self._finish_job(job)
                    return True
                entry = job.entries[job.index]
                job.lag = self.optimizer.version - entry.adapter_version
                job.current, job.path = self._start(entry)
                stale = entry.adapter_version if job.path == "stashed" else None
                live = self.config.stale_weights == "live"  # its copies hold the live values: no swap
                job.stashed_version, job.collect_from = (None, stale) if live else (stale, None)
                if job.current is None:  # stale and dropped
                    job.index += 1
                    return True
            self.slice_item = f"{self.mode} {job.path} job"
            try:
                with self._weights_for(job):
                    next(job.current)
            except StopIteration as stop:
                if job.collect_from is not None:  # gradients on the copies a recording saved (eval gate)
                    self.stash.collect_gradients(job.collect_from)
                    job.collect_from = None
                self.cache.free_activations(job.entries[job.index])
                job.results.append(stop.value)
                job.paths.append(job.path)
                job.path_of[job.entries[job.index].completion_id] = job.path
                job.finite_of[job.entries[job.index].completion_id] = math.isfinite(stop.value.loss)
                job.lags.append(job.lag)
                job.current = None
                job.index += 1
        except Exception:  # noqa: BLE001 - a failed job must not stop serving
            # the entry it was on is dropped; the others train again (the optimizer step failing: all dropped)
            failed = job.entries[job.index] if job.index < len(job.entries) else None
            logger.exception("training job failed on %s; dropping it", failed.completion_id if failed else "its step")
            with self.stats.lock:
                self.stats.failed_jobs += 1
            if job.current is not None:
                job.current.close()
            self._discard_gradients(job)
            for entry in job.entries:
                if failed is None or entry is failed:
                    self.cache.end(entry, EntryState.DROPPED, reason="job_failed")
                else:
                    self._requeue(entry)
            self._job = None
            self.release_unneeded_weights()
        return True

    def _take_late_entries(self, job: _Job) -> bool:
        """Entries that became ready while `job` ran (a label that came in meanwhile) join
        it before its optimizer step, up to its limit: waiting for the next step would
        make them a version staler, and could push them past `max_staleness`. A cohort
        takes recordings only: entries trained by recomputation keep their smaller steps."""
        limit = self.config.cohort_max_entries if job.cohort else self.config.entries_per_step
        room = limit - len(job.entries)
        late = self.cache.take_ready(room, self.optimizer.version, self._staleness_bound(),
                                     recorded_only=job.cohort) if room > 0 else []
        job.entries += late
        return bool(late)

    def _weights_for(self, job: _Job):
        """The weights a slice of `job` runs with: its version's stashed ones, or the live."""
        if job.stashed_version is None:
            return contextlib.nullcontext()
        return self.stash.weights_of(job.stashed_version)

    def _start(self, entry: CacheEntry):
        """(job generator, path) for an entry. A label entry (never recorded) is
        recomputed, never stale: nothing recorded under older weights is used; a recorded
        one stale within `max_staleness` trains on its recording with its version's
        weights stashed; staler (or its recording released), it is recomputed or dropped
        (`stale_policy`)."""
        lag = self.optimizer.version - entry.adapter_version
        if entry.recording is None and (lag == 0 or not entry.was_recorded):
            # a label entry is computed at the current version, whatever its own: never stale
            return self.method.recompute_job(entry, self.context), "recompute"
        self.context.under_served_weights = True
        if lag == 0:
            return self.method.reuse_job(entry, self.context), "reuse"
        if (entry.recording is not None and lag <= self.config.max_staleness
                and self.stash.has(entry.adapter_version)):
            if self.config.stale_weights == "live":
                self.stash.aim_at_live(entry.adapter_version)
                self.context.under_served_weights = False
            return self.method.reuse_job(entry, self.context), "stashed"
        drop = self.config.stale_policy == "drop"
        with self.stats.lock:
            self.stats.stale_entries += 1
            self.stats.stale_dropped += drop
        self.cache.free_activations(entry)  # never back-propagate a graph recorded under other weights
        if drop:
            self.cache.end(entry, EntryState.DROPPED, reason="stale")
            return None, ""
        return self.method.recompute_job(entry, self.context), "recompute"

    def _finish_job(self, job: _Job) -> None:
        finite = all(math.isfinite(r.loss) for r in job.results)
        if job.results and self.replicas is not None:
            self.replicas.contribute(len(job.results), finite)
            job.contributed = True
            return
        stepped = self._step(finite, len(job.results)) if job.results else False
        self._close_job(job, stepped)

    def _step(self, finite: bool, entries: int) -> bool:
        """The optimizer step on the gradients the parameters hold; whether it applied."""
        version = self.optimizer.version
        if self.config.max_staleness and (version in self.cache.recorded_versions() or self.lifecycle.gate is not None):
            # recordings of this version outlive its weights; with a gate, serving (and
            # recording) stays on it while the new version is a candidate
            self.stash.keep(version)
        updates = -(-entries // self.config.entries_per_step)  # one AdamW update per entries_per_step
        stepped = self.optimizer.step(loss_is_finite=finite, entries=entries, updates=updates)
        if stepped:
            self.cache.release_stale(self.optimizer.version, self._staleness_kept())
        return stepped

    def apply_combined(self, step: CombinedStep) -> None:
        """(replicas) A round's step, between jobs (device thread): every replica's summed
        gradients; this replica's waiting job ends with it when it is in it."""
        self.replicas.load_gradients(step)
        stepped = self._step(step.finite, step.entries)
        job = self._job
        if step.mine and job is not None and job.contributed:
            self._close_job(job, stepped)
        else:
            self.lifecycle.after_step(stepped)
            self.release_unneeded_weights()

    def _close_job(self, job: _Job, stepped: bool) -> None:
        """Counts a finished job and ends its entries (`stepped`: its step applied)."""
        if job.results:
            losses = [r.loss for r in job.results]
            with self.stats.lock:
                self.stats.last_loss = sum(losses) / len(losses)
                if stepped:
                    self.stats.train_tokens += sum(r.tokens for r in job.results)
                    for path in job.paths:
                        key = (self.mode, path)
                        self.stats.trained_entries[key] = self.stats.trained_entries.get(key, 0) + 1
                    for lag in job.lags:
                        self.stats.staleness[lag] = self.stats.staleness.get(lag, 0) + 1
                    _add_job_metrics(self.stats, job.results)
        trained = [e for e in job.entries if e.state is EntryState.TRAINING]
        if not stepped:
            self._end_skipped(job, trained)
            trained = []
        for entry in trained:  # their fates are queued before a save of the version can be
            self.cache.end(entry, EntryState.TRAINED, self.optimizer.version, job.path_of.get(entry.completion_id))
        if job.results:
            self.lifecycle.after_step(stepped, trained)
        self._job = None
        self.release_unneeded_weights()

    def _end_skipped(self, job: _Job, entries: list[CacheEntry]) -> None:
        """The entries of a step skipped for a non-finite loss or gradient are in no
        weights: one whose own loss was not finite is dropped; the others train again, once
        (a second skip drops them: a gradient that is never finite must not loop)."""
        for entry in entries:
            if entry.completion_id in self.cache.deleted_ids:  # (replicas: deleted while its round ran)
                self.cache.end(entry, EntryState.DROPPED, reason="deleted")
            elif not job.finite_of.get(entry.completion_id, True):
                self.cache.end(entry, EntryState.DROPPED, reason="non_finite_loss")
            elif entry.retried_after_skip:
                self.cache.end(entry, EntryState.DROPPED, reason="step_skipped")
            else:
                entry.retried_after_skip = True
                self._requeue(entry)

    def _staleness_bound(self) -> int:
        """How many versions old a recording may be and still be trained on."""
        return self.config.max_staleness

    def _staleness_kept(self) -> int:
        """How many versions old a recording may be and keep its activations: the
        configured bound, unless the device budget needs its never-freed tensors' room."""
        if self.offloader is not None and not self.offloader.kept_fit():
            return 0
        return self.config.max_staleness

    def release_unneeded_weights(self) -> None:
        """Frees the stashed weights of versions no waiting recording, nor recording to
        come (the version serving), needs."""
        self.stash.release_except(self.cache.recorded_versions() | {self.lifecycle.serving_version()})

    def abandon_job(self, of: set[str] | None = None) -> bool:
        """Drops the job in progress — or, with `of`, only a job training one of those
        completions, and only before its gradients went to a replicas' round: its gradients
        are discarded and its entries requeued. The entry it was working on is recomputed:
        its backward may have consumed part of its recording. Whether a job was dropped."""
        job = self._job
        if job is None or (of is not None and (job.contributed or not any(e.completion_id in of
                                                                            for e in job.entries))):
            return False
        self._job = None
        if job.current is not None:
            job.current.close()
            self.cache.free_activations(job.entries[job.index])
        self._discard_gradients(job)
        for entry in job.entries:
            self._requeue(entry)
        return True

    def _requeue(self, entry: CacheEntry) -> None:
        """An entry of a dropped job trains again (recomputed if the job spent its recording)."""
        if entry.recording is None:  # spent by this job: recomputed as a label entry, not counted stale
            entry.was_recorded = False
        self.cache.requeue(entry)

    def _discard_gradients(self, job: _Job) -> None:
        """A dropped job's gradients: the live weights', and those its entry in progress left
        on the copies its recording saved (stale_weights "live")."""
        if job.collect_from is not None:
            self.stash.discard_gradients(job.collect_from)
        self.optimizer.zero_grad()


def _add_job_metrics(stats: TrainingStats, results: list[JobResult]) -> None:
    """Sums the figures of an applied step's jobs into `stats` (its lock held), each job's
    only where all of them are finite."""
    for result in results:
        if not all(math.isfinite(value) for value in result.metrics.values()):
            continue  # a job's figures are counted together or not at all (ratios between them hold)
        for name, value in result.metrics.items():
            if name != "loss":
                stats.job_metric_sums[name] = stats.job_metric_sums.get(name, 0.0) + value
                stats.job_metric_counts[name] = stats.job_metric_counts.get(name, 0) + 1
