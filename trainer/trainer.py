"""The online trainer: trains the LoRA adapter in bounded slices, between serving steps.

`run_slice()` is called on the device thread by the arbiter (trainer/arbiter.py); each
call does one bounded slice of the current job (a layer's forward or backward, a loss,
or the optimizer step), so a newly arrived request waits for at most one slice. What is
recorded and how entries come to exist is the recorder's (trainer/recorder.py); labels
arrive through `submit_feedback` (trainer/feedback.py); saving, resuming and rolling
back the adapter is `AdapterLifecycle`'s (trainer/lifecycle.py). The trainer is built
and wired by the composition root (server/build.py): it receives its collaborators.

Adapter versions: every optimizer step bumps the version. An entry recorded under an
older version `v`, at most `max_staleness` versions ago, trains on its recording with
θ_v's weights stashed (trainer/stash.py, path "stashed"): its gradient is exactly
∇L(θ_v), applied to the current weights. An older one is never back-propagated: it
goes to the recompute path, or is dropped (`stale_policy`), and `stale_entries` counts it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field

from engine.malloc_tuning import return_freed_memory
from engine.model_runner import ModelRunner
from trainer.adapter import merge_all, merge_stale
from trainer.adapter_store import AdapterCheckpointer
from trainer.cache import ActivationCache, CacheEntry, EntryState
from trainer.config import TrainConfig
from trainer.feedback import FeedbackLabel, FeedbackOutcome, FeedbackResult, attach_label
from trainer.lifecycle import AdapterLifecycle
from trainer.methods import JobResult, TrainContext, TrainingMethod
from trainer.optimizer import AdapterOptimizer
from trainer.stash import WeightStash
from trainer.status import (SLICE_BUCKETS, CacheStatus, OffloadStatus, SaveStatus, TrainerStatus,
                            TrainingStats)

logger = logging.getLogger(__name__)

# released activation bytes after which an idle slice returns freed memory to the OS,
# once no prefill has been recorded for this long: a recording into pages just given
# back pays first-touch page faults (`alchemist bench recording`, case trained: 1.76x a
# plain 100-token prefill when trimming after every job, 1.23x without)
_TRIM_AFTER_BYTES = 64 << 20
_TRIM_QUIET_S = 10.0


@dataclass
class _Job:
    entries: list[CacheEntry]
    # the generator of the entry being worked on, and which path it takes
    current: object = None
    path: str = ""
    # the adapter version whose stashed weights its slices run with (path "stashed")
    stashed_version: int | None = None
    # versions the entry being worked on lagged when it started, and each finished one's
    lag: int = 0
    lags: list[int] = field(default_factory=list)
    index: int = 0
    results: list[JobResult] = field(default_factory=list)
    # the path each finished entry took
    paths: list[str] = field(default_factory=list)


class Trainer(AdapterLifecycle):
    def __init__(self, config: TrainConfig, method: TrainingMethod, runner: ModelRunner, peft_model,
                 optimizer: AdapterOptimizer, cache: ActivationCache, stats: TrainingStats, tokenizer,
                 max_model_len: int, engine_steps, offloader=None, stash: WeightStash | None = None,
                 warmer=None):
        """`engine_steps()`: serving steps run so far (tells a preempted job); `offloader`:
        the activation offloader, when a device budget is set; `stash`: past versions'
        weights, for recordings up to `max_staleness` versions old; `warmer`: pre-faulted heap
        for the next recording, grown in idle slices (engine.malloc_tuning.HeapWarmer)."""
        self.config = config
        self.method = method
        self.mode = method.name
        self.peft_model = peft_model
        self.optimizer = optimizer
        self.cache = cache
        self.stats = stats
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.offloader = offloader
        self.stash = stash
        self.warmer = warmer
        # the reward function's scorer (trainer/rewards.py), when train.reward_function is set
        self.rewards = None
        self.context = TrainContext(runner, peft_model, offloader, config.head_chunk_rows)
        self._engine_steps = engine_steps
        self._job: _Job | None = None
        self._engine_steps_at_last_slice = 0
        self._released_at_last_trim = 0
        # merged serving weights are rebuilt in slices after every optimizer step
        self._merge_pending = False
        self.checkpointer: AdapterCheckpointer | None = None
        # the saved version the adapter was last restored from (resume or rollback)
        self.restored_from: int | None = None

    # -- merged serving weights -------------------------------------------------------

    def merge_all(self) -> None:
        """Rebuilds every stale merged serving weight now (at start, nobody waits)."""
        if self.config.merged_serving:
            merge_all(self.peft_model)
        self._merge_pending = False

    def invalidate_merged(self) -> None:
        """The adapter changed: merged serving weights are rebuilt in the next slices."""
        self._merge_pending = self.config.merged_serving

    def serving_maintenance_pending(self) -> bool:
        return self._merge_pending

    def run_serving_maintenance(self, budget_s: float) -> bool:
        """Rebuilds stale merged serving weights for about `budget_s` (between serving
        steps); False when they are all current."""
        if self._merge_pending and merge_stale(self.peft_model, budget_s):
            return True
        self._merge_pending = False
        return False

    # -- feedback (HTTP thread) ----------------------------------------------------------

    def submit_feedback(self, request: FeedbackLabel) -> FeedbackResult:
        """Attaches a label (a preference, or a group's rewards) to a completion's entry;
        the outcome is counted."""
        if not self.method.uses_feedback:
            result = FeedbackResult(FeedbackOutcome.INVALID, f"feedback is used by preference and group training; "
                                    f"this server trains in {self.mode!r} mode (start it with --train-mode dpo or "
                                    "grpo)", None, "feedback_not_used")
        else:
            result = attach_label(self.cache, request, self._response_ids, self.max_model_len,
                                  self.method.label_kind)
        key = result.outcome.value
        self.stats.feedback[key] = self.stats.feedback.get(key, 0) + 1
        if result.accepted and request.rewards is not None:
            self.stats.rewarded_groups += 1
            self.stats.rewards_received += len(request.rewards)
            self.stats.reward_sum += sum(request.rewards)
            self.stats.last_group_mean_reward = sum(request.rewards) / len(request.rewards)
            self.stats.zero_advantage_groups += result.skipped
        return result

    def _response_ids(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        eos = self.tokenizer.eos_token_id
        return ids + ([eos] if eos is not None else [])

    # -- training (device thread) --------------------------------------------------------

    def has_work(self) -> bool:
        return (self._job is not None or self._merge_pending or self.cache.count(EntryState.READY) > 0
                or self.cache.has_pending_release()
                or (self.warmer is not None and self.warmer.wants_to_grow()))

    def run_slice(self) -> bool:
        """One bounded slice of training; False if there was nothing to do."""
        started = time.perf_counter()
        in_progress = self._job is not None or self._merge_pending
        engine_steps = self._engine_steps()
        if in_progress and engine_steps != self._engine_steps_at_last_slice:
            self.stats.preemptions += 1  # serving ran in between; the job resumes here
        worked = self._run_slice()
        self._engine_steps_at_last_slice = engine_steps
        if worked:
            seconds = time.perf_counter() - started
            self.stats.slices += 1
            self.stats.busy_seconds += seconds
            self.stats.max_slice_seconds = max(self.stats.max_slice_seconds, seconds)
            bucket = next(b for b in SLICE_BUCKETS if seconds <= b)
            self.stats.slice_buckets[bucket] += 1
        return worked

    def _run_slice(self) -> bool:
        self.cache.expire()
        if self._job is None and self._merge_pending:
            if merge_stale(self.peft_model):
                return True  # serving speed first: merged weights are rebuilt before the next job
            self._merge_pending = False
        if self._job is None:
            if self._return_freed_memory():  # between jobs: RSS follows the live activations
                return True
            # the next recording's pages are faulted in here, before any job, not in its
            # prefill: under traffic the trainer is rarely without a job
            if self.warmer is not None and self.warmer.grow():
                return True
            entries = self.cache.take_ready(self.config.entries_per_step, self.optimizer.version,
                                            self._staleness_bound())
            if not entries:
                return False
            self._job = _Job(entries)
        job = self._job
        try:
            if job.current is None:
                if job.index == len(job.entries) and not self._take_late_entries(job):
                    self._finish_job(job)
                    return True
                entry = job.entries[job.index]
                job.lag = self.optimizer.version - entry.adapter_version
                job.current, job.path = self._start(entry)
                job.stashed_version = entry.adapter_version if job.path == "stashed" else None
                if job.current is None:  # stale and dropped
                    job.index += 1
                    return True
            try:
                with self._weights_for(job):
                    next(job.current)
            except StopIteration as stop:
                self.cache.free_activations(job.entries[job.index])
                job.results.append(stop.value)
                job.paths.append(job.path)
                job.lags.append(job.lag)
                job.current = None
                job.index += 1
        except Exception:  # noqa: BLE001 - a failed job must not stop serving
            logger.exception("training job failed; dropping its entries")
            self.stats.failed_jobs += 1
            self.optimizer.zero_grad()
            for entry in job.entries:
                self.cache.end(entry, EntryState.DROPPED)
            self._job = None
            self.release_unneeded_weights()
        return True

    def _take_late_entries(self, job: _Job) -> bool:
        """Entries that became ready while `job` ran (a label that came in meanwhile) join
        it before its optimizer step, up to `entries_per_step`: waiting for the next step
        would make them a version staler, and could push them past `max_staleness`."""
        room = self.config.entries_per_step - len(job.entries)
        late = self.cache.take_ready(room, self.optimizer.version, self._staleness_bound()) if room > 0 else []
        job.entries += late
        return bool(late)

    def _return_freed_memory(self) -> bool:
        """An idle slice that gives freed activation memory back to the OS, once enough
        was released since the last one and recording has paused (engine/malloc_tuning.py)."""
        if (self.cache.released_bytes - self._released_at_last_trim < _TRIM_AFTER_BYTES
                or self.cache.clock() - self.cache.last_recorded < _TRIM_QUIET_S):
            return False
        self._released_at_last_trim = self.cache.released_bytes
        if return_freed_memory():
            self.stats.memory_trims += 1
        return True

    def _weights_for(self, job: _Job):
        """The weights a slice of `job` runs with: its version's stashed ones, or the live."""
        if job.stashed_version is None:
            return contextlib.nullcontext()
        return self.stash.weights_of(job.stashed_version)

    def _start(self, entry: CacheEntry):
        """(job generator, path) for an entry. Without activations (a label entry) it is
        recomputed; stale within `max_staleness`, it trains on its recording with its
        version's weights stashed; staler, it is recomputed or dropped (`stale_policy`)."""
        lag = self.optimizer.version - entry.adapter_version
        if lag == 0:
            if entry.recording is None:
                return self.method.recompute_job(entry, self.context), "recompute"
            return self.method.reuse_job(entry, self.context), "reuse"
        if (entry.recording is not None and lag <= self.config.max_staleness and self.stash is not None
                and self.stash.has(entry.adapter_version)):
            return self.method.reuse_job(entry, self.context), "stashed"
        self.stats.stale_entries += 1
        entry.release()  # never back-propagate a graph recorded under other weights
        if self.config.stale_policy == "drop":
            self.stats.stale_dropped += 1
            self.cache.end(entry, EntryState.DROPPED)
            return None, ""
        return self.method.recompute_job(entry, self.context), "recompute"

    def _finish_job(self, job: _Job) -> None:
        losses = [r.loss for r in job.results]
        finite = all(math.isfinite(v) for v in losses)
        if job.results:
            version = self.optimizer.version
            if self.stash is not None and self.config.max_staleness and version in self.cache.recorded_versions():
                self.stash.keep(version)  # recordings of this version outlive its weights
            if self.optimizer.step(loss_is_finite=finite, entries=len(job.results)):
                self.cache.release_stale(self.optimizer.version, self._staleness_kept())
                if self.checkpointer is not None and self.checkpointer.due(self.optimizer.version):
                    self.checkpointer.save_async(self.snapshot())
            self.invalidate_merged()
            self.stats.last_loss = sum(losses) / len(losses)
            self.stats.train_tokens += sum(r.tokens for r in job.results)
            for path in job.paths:
                key = (self.mode, path)
                self.stats.trained_entries[key] = self.stats.trained_entries.get(key, 0) + 1
            for lag in job.lags:
                self.stats.staleness[lag] = self.stats.staleness.get(lag, 0) + 1
        for entry in job.entries:
            if entry.state is EntryState.TRAINING:
                self.cache.end(entry, EntryState.TRAINED)
        self._job = None
        self.release_unneeded_weights()

    def _staleness_bound(self) -> int:
        """How many versions old a recording may be and still be trained on."""
        return self.config.max_staleness if self.stash is not None else 0

    def _staleness_kept(self) -> int:
        """How many versions old a recording may be and keep its activations: the
        configured bound, unless the device budget needs its never-freed tensors' room."""
        if self.offloader is not None and not self.offloader.kept_fit():
            return 0
        return self.config.max_staleness

    def release_unneeded_weights(self) -> None:
        """Frees the stashed weights of versions no waiting recording needs."""
        if self.stash is not None:
            self.stash.release_except(self.cache.recorded_versions())

    def abandon_job(self) -> None:
        """Drops the job in progress: its gradients are discarded, its entries requeued."""
        job, self._job = self._job, None
        if job is None:
            return
        if job.current is not None:
            job.current.close()
        self.optimizer.zero_grad()
        for entry in job.entries:
            self.cache.requeue(entry)

    def train_until_idle(self, timeout_s: float = 600.0) -> None:
        """Runs slices until nothing is ready (tests, benchmarks, offline use)."""
        deadline = time.monotonic() + timeout_s
        while self.run_slice():
            if time.monotonic() > deadline:
                raise TimeoutError("training did not finish in time")

    # -- status and shutdown ----------------------------------------------------------

    def status(self) -> TrainerStatus:
        """A consistent copy of the trainer's state, for `/metrics` and `/v1/adapters`."""
        cache = CacheStatus(self.cache.bytes,
                            {s.value: self.cache.count(s) for s in (EntryState.WAITING_LABEL, EntryState.READY,
                                                                    EntryState.TRAINING)},
                            dict(self.cache.ended_counts), self.cache.label_entries,
                            self.cache.refused_label_entries)
        if self.offloader is None:
            offload = OffloadStatus(self.cache.bytes, 0)
        else:
            o = self.offloader.stats
            offload = OffloadStatus(self.offloader.device_bytes, self.offloader.host_bytes, o.offloaded_layers,
                                    o.dropped_layers, o.reloaded_layers, o.recomputed_layers, o.over_budget_steps,
                                    o.reload_wait_seconds)
        saves = None
        if self.checkpointer is not None:
            c = self.checkpointer
            saves = SaveStatus(str(c.store.root), c.save_every, c.saved, c.failed, c.last_saved_version)
        stash = (self.stash.versions, self.stash.nbytes) if self.stash is not None else ([], 0)
        return TrainerStatus(self.mode, self.optimizer.version, self.restored_from, self.optimizer.skipped_steps,
                             self.stats.copy(), cache, offload, saves, *stash)

    def close(self) -> None:
        """At shutdown (after the engine stopped): stops the offloader's copies and saves
        the final adapter version."""
        if self.offloader is not None:
            self.offloader.close()
        if self.rewards is not None:
            self.rewards.close()
        self.save_final()
