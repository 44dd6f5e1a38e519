"""Online training, assembled: the parts the composition root (server/build.py) builds and
hands to each other, and the few things done across them.

  - `run_slice()` is one item of device work in a gap between serving steps, as the
    arbiter runs it: due label expiries, then a slice of a candidate version's scoring
    (trainer/eval_gate.py; no job starts before its verdict), else, between jobs, a piece
    of housekeeping (trainer/maintenance.py), else a slice of the trainer's job
    (trainer/trainer.py); every item is timed into the training counters;
  - `status()` is the consistent snapshot `/metrics` and `/v1/adapters` read;
  - `rollback()` abandons the job in progress before the lifecycle swaps the weights;
    with data-parallel replicas, it asks every replica to roll back at the same round,
    and the rounds' steps and rollbacks are applied here, between jobs
    (trainer/replicated.py);
  - `forget()` deletes what is kept of a completion (ledger rows, cache entries), and
    `withdraw_from_training()` takes an entry deleted while it trains out of its job;
  - `close()` stops the offloader's copies and the reward workers, saves the final
    version and closes the feedback ledger.
Each part keeps its own role; this object only holds them and orders those steps.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import dataclass, field

from engine.hooks import EngineHooks, EngineObserver
from offload.offloader import ActivationOffloader
from trainer.adapter_store import AdapterSnapshot
from trainer.cache import ActivationCache
from trainer.entries import EntryState
from trainer.feedback import lone_prompts_id
from trainer.eval_gate import Verdict
from trainer.config import TrainConfig
from trainer.intake import FeedbackIntake
from trainer.label_history import is_prompt_of
from trainer.ledger import Ledger
from trainer.ledger_db import Deletion
from trainer.lifecycle import AdapterLifecycle
from trainer.maintenance import Maintenance
from trainer.methods import TrainContext, TrainingMethod
from trainer.optimizer import AdapterOptimizer
from trainer.recorder import Recorder
from trainer.replica_messages import LeftOut, ReplicatedRollback, ReplicatedVerdict
from trainer.replicated import ReplicaSync, weights_digest
from trainer.rewards import RewardScorer
from trainer.stash import WeightStash
from trainer.status import (SLICE_BUCKETS, CacheStatus, Forgotten, GateStatus, OffloadStatus, SaveStatus,
                            TrainerStatus, TrainingStats)
from trainer.trainer import Trainer

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class OnlineTraining:
    config: TrainConfig
    method: TrainingMethod
    peft_model: object
    optimizer: AdapterOptimizer
    cache: ActivationCache
    stats: TrainingStats
    stash: WeightStash
    # what a method's jobs run on (the runner, the PEFT model, the offloader)
    context: TrainContext
    trainer: Trainer
    maintenance: Maintenance
    lifecycle: AdapterLifecycle
    feedback: FeedbackIntake
    # the engine's recorder and observer
    recorder: Recorder
    # the activation offloader (a device budget is set) and the reward function's scorer
    offloader: ActivationOffloader | None = None
    rewards: RewardScorer | None = None
    # the feedback ledger (with an adapter directory)
    ledger: Ledger | None = None
    # the other data-parallel replicas' rounds (server/replicas.py), when there are any
    replicas: ReplicaSync | None = None
    # (replicas, rank 0) the gate's verdict, sent to every replica and not yet carried out
    _published: Verdict | None = field(default=None, init=False)
    # the adapter's digest and the version it is of
    _digest: tuple[int, str] | None = field(default=None, init=False)
    # (replicas) a round's result could not be applied here: this replica follows the sequence no more
    _left: bool = field(default=False, init=False)

    @property
    def mode(self) -> str:
        return self.method.name

    def engine_hooks(self, observers: tuple[EngineObserver, ...] = ()) -> EngineHooks:
        """What the engine is built with: the recorder, the offloader (room on the device,
        recorded segments), the stash (stale weights), the serving weights' generation (the
        prefix cache's), and `observers` besides the recorder."""
        return EngineHooks(recorder=self.recorder, memory_guard=self.offloader, segment_sink=self.offloader,
                           stale_resolver=self.stash.resolve, recording_weights=self.lifecycle.recording_weights,
                           weights_generation=self._serving_generation, observers=(*observers, self.recorder))

    def _serving_generation(self) -> int:
        return self.maintenance.serving_generation

    # -- device work in the gaps (device thread) -------------------------------------

    @property
    def gate(self):
        """The eval gate (trainer/eval_gate.py), or None."""
        return self.lifecycle.gate

    def _scoring(self) -> bool:
        """The eval gate is scoring a version, or (replicas) its verdict is on its way: no
        job starts meanwhile."""
        return self.gate is not None and (self.gate.pending or self._published is not None)

    def has_work(self) -> bool:
        return self.trainer.has_work() or self.maintenance.has_work() or self._scoring() or self.sync_due()

    def sync_due(self) -> bool:
        """(replicas) A round's step, rollback or verdict can be applied: no job is
        computing, and while a candidate waits for its verdict, that is what arrived."""
        if self.replicas is None or self._left or self.trainer.computing():
            return False  # (one that left applies no later result: its weights would not be the others')
        return self.replicas.has_verdict() if self._scoring() else self.replicas.has_result()

    def apply_synced(self) -> bool:
        """(replicas) Applies the rounds' results that wait, in order (device thread);
        whether there were any. Never under a computing job."""
        applied = False
        while self.sync_due():
            item = self.replicas.take_verdict() if self._scoring() else self.replicas.next_result()
            try:
                self._apply_synced_item(item)
                self._fates_queued()
            except Exception:  # this replica would leave the others' sequence: the group restarts
                logger.critical("replica %d could not apply %s; leaving the group, which restarts from rank 0's "
                                "adapter", self.replicas.rank, type(item).__name__, exc_info=True)
                self._left = True
                self.replicas.leave()
                raise
            applied = True
        return applied

    def _fates_queued(self) -> None:
        """(replicas) The ledger fates of the versions applied so far are queued: the rounds
        hear once they are committed, and rank 0 saves no version before every replica's are
        (trainer/replica_fates.py)."""
        fates, version = self.replicas.fates, self.optimizer.version
        if self.ledger is None:
            fates.written(version)
        else:
            self.ledger.when_written(lambda: fates.written(version))

    def _apply_synced_item(self, item) -> None:
        if isinstance(item, ReplicatedVerdict):
            if self._scoring():
                self._settle_everywhere(item)
            else:  # cannot come without a candidate; kept for the log
                logger.warning("a gate verdict arrived with no candidate waiting: %s", item)
        elif isinstance(item, LeftOut):  # its job ran on weights a rollback replaced: its entries train again
            logger.info("replica %d: a job of %d entries ran on weights a rollback replaced; they train again",
                        self.replicas.rank, item.entries)
            self.trainer.abandon_job()
        elif isinstance(item, ReplicatedRollback):
            # never abandons a job: a job here has handed its gradients to a round, whose step, if it
            # came before the rollback, every replica applies before it; if after, it is `LeftOut`.
            # Rank 0's request is answered once the rollback is saved, which waits for every
            # replica's fates of the versions it undid; this thread does not wait for that.
            version, saving = self.lifecycle.rollback_saved_later(item.snapshot)
            self.replicas.rollbacks_applied += 1
            if item.done is not None:
                def answer(_=None, done=item.done):
                    if not done.done():
                        done.set_result(version)
                if saving is None:
                    answer()
                else:
                    saving.add_done_callback(answer)
        else:
            self.trainer.apply_combined(item)

    def _settle_everywhere(self, verdict: ReplicatedVerdict) -> None:
        """(replicas) Carries out rank 0's verdict here, quarantining this replica's labels."""
        if self._published is not None:  # rank 0 scored it
            trained, self._published = self._published.trained_ids, None
        else:
            trained = self.gate.drop_candidate()
        self.lifecycle.settle(Verdict(verdict.scores, verdict.failures, trained, verdict.baseline))

    def _gate_slice(self) -> bool:
        """A slice of the candidate's scoring; its verdict is carried out here, or (replicas)
        sent to every replica from rank 0 — the others wait for it."""
        if self.replicas is None:
            verdict = self.gate.run_slice()
            if verdict is not None:
                self.lifecycle.settle(verdict)
            return True
        if self.replicas.rank != 0 or not self.gate.pending:
            return False
        verdict = self.gate.run_slice()
        if verdict is not None:
            self._published = verdict
            self.replicas.publish_verdict(ReplicatedVerdict(verdict.scores, verdict.failures, verdict.baseline))
        return True

    def in_progress(self) -> bool:
        """A job, a candidate's scoring or a rebuild of merged serving weights has begun
        and not finished."""
        return self.trainer.in_job() or self.maintenance.merged_stale() or self._scoring()

    def run_slice(self, serving_ran: bool = False) -> bool:
        """One bounded item of work; False if there was nothing to do. `serving_ran`:
        serving steps ran since the last item (a job in progress was preempted)."""
        started = time.perf_counter()
        if serving_ran and self.in_progress():
            with self.stats.lock:
                self.stats.preemptions += 1  # the job resumes here
        self.maintenance.expire()
        if self.sync_due():
            worked, item = self.apply_synced(), "replicas' step"
        elif self._scoring():  # no job starts before the candidate's verdict
            worked, item = self._gate_slice(), "eval gate"
        elif self.maintenance.warm_heap() if self.trainer.in_job() else self.maintenance.run_item():
            worked, item = True, "housekeeping"
        elif self.lifecycle.rollback_saving() and not self.trainer.in_job():  # (its held labels not yet let go)
            worked, item = False, "waiting for a rollback's save"
        else:
            worked, item = self.trainer.run_slice(), self.trainer.slice_item
        if worked:
            seconds = time.perf_counter() - started
            with self.stats.lock:
                self.stats.slices += 1
                self.stats.busy_seconds += seconds
                if seconds > self.stats.max_slice_seconds:
                    self.stats.max_slice_seconds, self.stats.max_slice_item = seconds, item
                self.stats.slice_buckets[next(b for b in SLICE_BUCKETS if seconds <= b)] += 1
        return worked

    def train_until_idle(self, timeout_s: float = 600.0) -> None:
        """Runs items until nothing is left (tests, benchmarks, offline use)."""
        deadline = time.monotonic() + timeout_s
        while self.run_slice():
            if time.monotonic() > deadline:
                raise TimeoutError("training did not finish in time")

    def rollback(self, snapshot: AdapterSnapshot) -> int | concurrent.futures.Future:
        """Makes a saved version the live adapter (device thread); the new version. A
        snapshot that does not fit is refused (AdapterMismatchError) with the job in
        progress untouched. With replicas (on rank 0), every replica rolls back at the
        next round: a future of the new version."""
        self.lifecycle.check(snapshot)
        if self.replicas is not None:
            return self.replicas.request_rollback(snapshot)
        self.trainer.abandon_job()  # its gradients were computed under the weights being replaced
        version = self.lifecycle.rollback(snapshot)
        if self.ledger is not None:  # (its fates wait for its save, which may fail: its number may not)
            self.ledger.version_named(version)
        return version

    def adapter_digest(self) -> str:
        """A hash of the live adapter's weights (device thread): equal on every replica."""
        version = self.optimizer.version
        if self._digest is None or self._digest[0] != version:
            self._digest = (version, weights_digest(self.optimizer.params))
        return self._digest[1]

    def forget(self, completion_id: str, label_only: bool = False) -> Forgotten:
        """Deletes what the server keeps of a completion — its label, or its request and
        label (users' data): the rows leave the ledger first (LedgerUnavailable if it
        cannot be written, with nothing changed), then its entry leaves the cache. An entry
        being trained is left for `withdraw_from_training`. A completion of several prompts
        is deleted with all of them (a list of one prompt, by `<id>-0` too); one still being
        generated whose request is not written yet is `pending`. A worker thread's call."""
        completion_id = lone_prompts_id(self.cache, self.ledger, completion_id)
        deletion = self.ledger.delete(completion_id, label_only) if self.ledger is not None else Deletion(False)
        withdrawn, training = False, []
        for request_id, fate in deletion.fates.items():  # its label, sent again, is told it was deleted
            self.cache.note_ended(request_id, None, deleted=True)
            if fate is None and self.cache.ended_state(request_id) is EntryState.TRAINED:
                training.append(request_id)  # its step landed as the deletion was written: in the weights
        for entry in self.cache.entries():
            if entry.completion_id != completion_id and not is_prompt_of(completion_id, entry.completion_id):
                continue
            if label_only and getattr(entry, "label", None) is None:
                continue
            if self.cache.withdraw(entry.completion_id):
                withdrawn = True
            elif entry.state is EntryState.TRAINING:
                training.append(entry.completion_id)
        found = deletion.found or withdrawn
        pending = not found and not label_only and self.cache.expected.holds_any(
            lambda request_id: request_id == completion_id or is_prompt_of(completion_id, request_id))
        return Forgotten(found, training, deletion.trained_into, pending)

    def withdraw_from_training(self, completion_ids: list[str]) -> list[str]:
        """Withdraws entries whose data were deleted while they trained (device thread): the
        job training them is dropped, its other entries requeued, so that a deleted label
        never reaches the weights. The ids it could not withdraw: their step was applied
        meanwhile, or its gradients already went to a replicas' round."""
        self.trainer.abandon_job(of=set(completion_ids))
        trained = [completion_id for completion_id in completion_ids if not self.cache.withdraw(completion_id)
                   and (self.cache.get(completion_id) is not None
                        or self.cache.ended_state(completion_id) is EntryState.TRAINED)]
        for completion_id in trained:
            self.cache.note_ended(completion_id, None, deleted=True)
        return trained

    # -- status and shutdown ----------------------------------------------------------

    def status(self) -> TrainerStatus:
        """A consistent copy of the training state, for `/metrics` and `/v1/adapters`."""
        cache = self.cache
        cache_status = CacheStatus(cache.bytes, {s.value: cache.count(s) for s in (
            EntryState.WAITING_LABEL, EntryState.READY, EntryState.TRAINING)}, dict(cache.ended_counts),
            cache.label_entries, cache.refused_label_entries, cache.budget_bytes)
        if self.offloader is None:
            offload = OffloadStatus(cache.bytes, 0)
        else:
            o = self.offloader.stats
            offload = OffloadStatus(self.offloader.device_bytes, self.offloader.host_bytes, o.offloaded_layers,
                                    o.dropped_layers, o.reloaded_layers, o.recomputed_layers, o.over_budget_steps,
                                    o.reload_wait_seconds, o.rerun_training_layers)
        saves = None
        checkpointer = self.lifecycle.checkpointer
        if checkpointer is not None:
            saves = SaveStatus(str(checkpointer.store.root), checkpointer.save_every, checkpointer.saved,
                               checkpointer.failed, checkpointer.last_saved_version)
        ledger = dataclasses.replace(self.ledger.stats) if self.ledger is not None else None
        return TrainerStatus(self.mode, self.lifecycle.serving_version(), self.lifecycle.restored_from,
                             self.optimizer.skipped_steps, self.stats.copy(), cache_status, offload, saves,
                             self.stash.versions, self.stash.nbytes, ledger, self._gate_status(),
                             warm_heap_bytes=self.maintenance.warm_heap_bytes)

    def _gate_status(self) -> GateStatus | None:
        gate = self.gate
        if gate is None:
            return None
        rejected = None
        if gate.last_rejected is not None:
            scores, failures = gate.last_rejected
            rejected = {**scores.as_dict(), "failures": list(failures)}
        promoted = gate.promoted.as_dict() if gate.promoted else None
        if promoted is not None and gate.rescoring:  # (not the scores of the weights serving)
            promoted.update(preference_margin=None, completion_logprob=None, kl=None)
        s = gate.stats
        return GateStatus(gate.candidate_version, promoted, rejected, s.evaluations, s.eval_seconds, s.promoted,
                          s.rejected)

    def close(self) -> None:
        """At shutdown (after the engine stopped): stops the offloader's copies and the
        reward workers, leaves the replicas' rounds, and saves the final adapter version."""
        if self.replicas is not None:
            self.replicas.close()  # every replica leaves at the same round; what it sent applies here too
            # and so do the others' steps: a job still computing here gives way (its labels are in the
            # ledger, untrained), or this replica would save a version behind theirs, and they would
            # end their entries in a version no replica saves
            if self.trainer.computing():
                self.trainer.abandon_job()
            self.apply_synced()
            if self.ledger is not None:
                self.ledger.flush()  # the fates of the steps just applied, before the last word confirms them
            self.replicas.last_word()
        if self.offloader is not None:
            self.offloader.close()
        if self.rewards is not None:
            self.rewards.close()
        if self._left:  # its weights are not the sequence's: the group restarts from the last version saved
            logger.error("replica %d left the group: its adapter is not saved at shutdown", self.replicas.rank)
        else:
            self.lifecycle.save_final(candidate_waits=self._published is not None)
        if self.ledger is not None:
            self.ledger.close()
