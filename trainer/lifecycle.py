"""The adapter's lifecycle: what becomes of a new version (merged serving weights
rebuilt, saved every `save_every` versions), and the adapter on disk — resume, snapshot,
rollback (a saved adapter checked against the configured one: trainer/adapter_store.py).

With an eval gate (trainer/eval_gate.py) a new version is a candidate until its verdict:
`settle` promotes it (serving moves to it; only promoted versions are saved, with their
scores, so a restart serves the last promoted one) or rejects it (the promoted weights and
optimizer state come back as a new version number, the step's labels are quarantined in
the ledger, and the rollback is counted with reason "eval_gate").

A rollback's ledger fates are written once its save lands or fails (jobs wait meanwhile).
One whose save failed still serves, and every later snapshot carries it (`state["rollbacks"]`:
[restored, as version]) until one is saved; a restart before that resumes the last saved
version, and the ledger's fates follow those weights (trainer/ledger_lineage.py).

Everything here runs on the device thread (weights change between steps, never under
one). A rollback abandons the job in progress first; that is the caller's
(`OnlineTraining.rollback`), since the job belongs to the trainer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import sqlite3
import threading

import torch

from trainer import ledger_lineage
from trainer.adapter_store import AdapterCheckpointer, AdapterSnapshot, SavedVersion, check_compatible
from trainer.cache import ActivationCache
from trainer.eval_gate import EvalGate, Verdict
from trainer.ledger import Ledger, LedgerUnavailable
from trainer.ledger_db import read_ledger
from trainer.maintenance import Maintenance
from trainer.optimizer import AdapterOptimizer
from trainer.stash import WeightStash
from trainer.status import TrainingStats

logger = logging.getLogger(__name__)


class AdapterLifecycle:
    def __init__(self, peft_model, optimizer: AdapterOptimizer, cache: ActivationCache, stash: WeightStash,
                 maintenance: Maintenance, stats: TrainingStats, mode: str,
                 checkpointer: AdapterCheckpointer | None = None, gate: EvalGate | None = None,
                 ledger: Ledger | None = None):
        """`checkpointer`: saves versions to the adapter directory (None: none is set);
        `gate`: the eval gate (None: every version serves at once); `ledger`: where
        rejected labels are quarantined."""
        self.gate = gate
        self.ledger = ledger
        # the promoted version's weights and optimizer state, to return to (with a gate)
        self.promoted_snapshot: AdapterSnapshot | None = None
        self.peft_model = peft_model
        self.optimizer = optimizer
        self.cache = cache
        self.stash = stash
        self.maintenance = maintenance
        self.stats = stats
        self.mode = mode
        self.checkpointer = checkpointer
        # the saved version the adapter was last restored from (resume or rollback)
        self.restored_from: int | None = None
        # (restored, as version) of rollbacks not saved yet (their save failed, or is on its way),
        # oldest first: carried by every snapshot until one is saved (replaced whole, never
        # changed in place, under the lock: a save's callback changes it on the checkpointer's thread)
        self._unsaved_rollbacks: tuple[tuple[int, int], ...] = ()
        self._carried_lock = threading.Lock()
        self._rollback_saves_in_flight = 0
        # the saved version whose weights the live adapter holds, untrained since it was restored
        # (a rollback, the gate's return): named in its snapshots, so the store prunes copies first
        self._weights_of: int | None = None
        # (restored, as version) of the rollbacks whose fates this start applied again (`resume`)
        self._replayed_rollbacks: list[tuple[int, int]] = []

    def start(self) -> None:
        """Resumes from the latest good saved version, if any (else saves version 0, so
        there is always a version to roll back to), and scores it as the gate's bar. Call
        before serving starts."""
        self.resume(self.known_version())
        self.score_baseline()

    def known_version(self) -> int:
        """The highest version this process's ledger knows of (-1: none, or no ledger)."""
        return ledger_lineage.highest_version(self.ledger.path) if self.ledger is not None else -1

    def resume(self, known: int) -> None:
        """The first half of `start`: the saved adapter, or version 0 saved. `known`: the
        highest version any ledger knows of (every replica's node's): numbers up to it,
        served or trained before a crash, are not given to the weights resumed."""
        if self.checkpointer is not None:
            snapshot = self.checkpointer.store.latest()
            saved, known = -1 if snapshot is None else snapshot.version, max(known, self.checkpointer.mark.given)
            version = max(saved, 0) if known <= saved else known + 1
            if snapshot is not None:
                self.restore(snapshot, version)
                # the rollbacks its saves failed to record, then its own (a kill may have cut their fates
                # short), before the fates follow the weights resumed (those of lost versions after it)
                replayed = [tuple(pair) for pair in snapshot.state.get("rollbacks", [])]
                if "rolled_back_to" in snapshot.state:
                    replayed.append((snapshot.state["rolled_back_to"], snapshot.version))
                self._replayed_rollbacks = replayed
                for restored, as_version in replayed:
                    self._ledger_after_rollback(restored, as_version)
                self.checkpointer.resumed(snapshot.version, version)
                self.maintenance.merge_all()
                logger.info("resumed adapter version %d from %s%s", snapshot.version, self.checkpointer.store.root,
                            "" if version == snapshot.version else f" as version {version} (versions after it "
                            "died unsaved with the last process; their numbers are not given to other weights)")
            else:
                self.optimizer.version = version
                self.checkpointer.resumed(None, version)
                self.checkpointer.save_async(self.snapshot()).result()

    def adoptable(self) -> AdapterSnapshot:
        """(replicas, rank 0) The resumed adapter every replica adopts, naming the rollbacks
        whose fates this start applied again."""
        snapshot = self.snapshot()
        snapshot.state["rollbacks_replayed"] = [list(pair) for pair in self._replayed_rollbacks]
        return snapshot

    def adopted(self, snapshot: AdapterSnapshot) -> None:
        """This replica took rank 0's resumed adapter `snapshot`: one that saves no version
        applies again the fates of the rollbacks rank 0 applied again, as rank 0's start did
        in its own (another node's ledger may have lost them to a kill; applying them twice
        changes nothing), then tells its node's ledger which versions died unsaved."""
        self.restored_from = snapshot.state.get("restored_from")
        if self.checkpointer is None and self.ledger is not None:
            for restored, as_version in snapshot.state.get("rollbacks_replayed", []):
                self._ledger_after_rollback(restored, as_version)
            self.ledger.resumed(-1 if self.restored_from is None else self.restored_from, snapshot.version,
                                saving=False)

    def score_baseline(self) -> None:
        """The second half of `start`: with a gate, the live weights' scores are the bar."""
        if self.gate is not None:  # the version serving now is the promoted one: its scores are the bar
            version = self.optimizer.version
            scores = self.gate.score_now(version)
            self.gate.settled(Verdict(scores, baseline=True), version)
            self.promoted_snapshot = self.snapshot()
            logger.info("eval gate: version %d scores %s", version, scores.as_dict())

    def serving_version(self) -> int:
        """The version requests are served with: the promoted one while a candidate waits."""
        if self.gate is not None and self.gate.promoted is not None:
            return self.gate.promoted.version
        return self.optimizer.version

    def can_record(self) -> bool:
        """A prefill can be recorded under the version serving: it is the live one, or
        (while the eval gate scores a candidate) its weights are in the stash."""
        version = self.serving_version()
        return version == self.optimizer.version or self.stash.has(version)

    def recording_weights(self, version: int):
        """The LoRA weights a prefill recorded under `version` runs with: the live ones, or
        while a candidate is live and serving stays on the promoted version, the promoted
        version's from the stash — its recording then trains on the stashed path, as any
        recording one version old does, instead of being recomputed."""
        if version == self.optimizer.version:
            return contextlib.nullcontext()
        return self.stash.weights_of(version)

    def after_step(self, stepped: bool, entries=()) -> None:
        """An optimizer step ran on `entries` (`stepped`: it changed the weights): merged
        serving weights go stale, and the version is saved if one is due — or, with a
        gate, the new version is a candidate and waits for its verdict."""
        if stepped:
            self._weights_of = None
        if stepped and self.gate is not None:
            self.gate.candidate(self.optimizer.version, entries)
            return
        if stepped and self.checkpointer is not None and self.checkpointer.due(self.optimizer.version):
            self._save(self.snapshot())
        self.maintenance.invalidate_merged()

    def settle(self, verdict: Verdict) -> None:
        """Carries out the gate's verdict on the candidate (device thread)."""
        if verdict.baseline:  # the bar for the next candidates
            self.gate.settled(verdict, self.optimizer.version)
            return
        if verdict.promoted:
            version = self.optimizer.version
            self.gate.settled(verdict, version)
            self.promoted_snapshot = self.snapshot()
            self.maintenance.invalidate_merged()
            last = self.checkpointer.last_saved_version if self.checkpointer is not None else None
            if self.checkpointer is not None and (last is None or version - last >= self.checkpointer.save_every):
                self._save(self.promoted_snapshot)
            logger.info("eval gate: version %d promoted, %s", version, verdict.scores.as_dict())
            return
        rejected, promoted = verdict.scores.version, self.promoted_snapshot.version
        version = self.optimizer.version + 1
        self.restore(self.promoted_snapshot, version)
        self.gate.settled(verdict, version)
        reason = f"eval gate rejected version {rejected}: " + "; ".join(verdict.failures)
        quarantined = [request for request in verdict.trained_ids if request not in self.cache.deleted_ids]
        with self.stats.lock:
            self.stats.rollbacks["eval_gate"] += 1
            self.stats.quarantined_labels += len(quarantined)
        if self.ledger is not None:  # (it drops those whose labels were deleted since)
            self.ledger.quarantine(list(verdict.trained_ids), reason, version, promoted)
        self.promoted_snapshot = self.snapshot()  # (a copy: `weights_of`, pruned before distinct versions)
        if self.checkpointer is not None:
            self._save(self.promoted_snapshot)
        logger.warning("%s; serving stays on the promoted weights (now version %d); %d labels quarantined",
                       reason, version, len(quarantined))

    def saved_versions(self) -> list[SavedVersion]:
        """The versions on disk, oldest first (none without an adapter directory)."""
        return self.checkpointer.store.versions() if self.checkpointer is not None else []

    def load_saved(self, version: int) -> AdapterSnapshot:
        """Reads a saved version (disk I/O: call off the event loop) once the saves in flight
        have landed (a version just trained may be on its way to disk); AdapterLoadError. A
        version pruned for a copy of its weights is read from the copy."""
        self.checkpointer.wait()
        return self.checkpointer.store.load(self.checkpointer.store.holder_of(version))

    def snapshot(self) -> AdapterSnapshot:
        from peft import get_peft_model_state_dict

        weights = {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(self.peft_model).items()}
        state = {"mode": self.mode, "restored_from": self.restored_from,
                 "entries_in_weights": self.optimizer.entries_in_weights}
        if self._unsaved_rollbacks:
            state["rollbacks"] = [list(pair) for pair in self._unsaved_rollbacks]
        if self._weights_of is not None and self._weights_of != self.optimizer.version:
            state["weights_of"] = self._weights_of  # a copy of that version's weights
        if self.gate is not None and self.gate.promoted is not None and not self.gate.pending:
            state["gate"] = {"status": "promoted", "scores": self.gate.promoted.as_dict()}
        return AdapterSnapshot(self.optimizer.version, weights, self.peft_model.peft_config["default"],
                               self.optimizer.state_dict(), state)

    def check(self, snapshot: AdapterSnapshot) -> None:
        """Raises AdapterMismatchError if `snapshot` cannot be loaded into the live adapter."""
        from peft import get_peft_model_state_dict

        check_compatible(self.peft_model.peft_config["default"], snapshot,
                         get_peft_model_state_dict(self.peft_model))

    def restore(self, snapshot: AdapterSnapshot, version: int) -> None:
        """Loads `snapshot` into the live adapter as adapter `version` (no job may be in
        progress). Recordings made under other weights lose their activations: they take
        the recompute path."""
        from peft import get_peft_model_state_dict

        self.check(snapshot)
        live = get_peft_model_state_dict(self.peft_model)
        with torch.no_grad():
            for name, tensor in live.items():
                tensor.copy_(snapshot.weights[name])
        self.optimizer.load_state_dict(snapshot.optimizer_state, version, snapshot.state.get("entries_in_weights", 0))
        self.cache.release_stale(version)
        self.stash.release_except(self.cache.recorded_versions())
        self.restored_from = snapshot.version
        self._weights_of = snapshot.state.get("weights_of", snapshot.version)
        self.maintenance.invalidate_merged()

    def rollback(self, snapshot: AdapterSnapshot) -> int:
        """Makes the saved `snapshot` the live adapter. Versions only go forward: the
        rolled-back adapter is a new version, saved before this returns (a restart resumes
        from it, not from a version it undid), so nothing recorded under the weights being
        replaced is mistaken for current. Once it is saved, the labels the undone versions
        trained on are quarantined in the ledger (`alchemist feedback release` trains them
        again); if the save fails, the rollback serves but a restart resumes from before it."""
        version, saving = self.rollback_saved_later(snapshot)
        if saving is not None:
            saving.result()
        return version

    def rollback_saved_later(self, snapshot: AdapterSnapshot) -> tuple[int, concurrent.futures.Future | None]:
        """`rollback` without waiting for its save (replicas' rank 0: the save waits for every
        replica's fates of the versions it undid, trainer/replica_fates.py): the new version,
        and a future of whether it was saved, done once its fates are through (None: nothing
        saves here). Until saved, every snapshot carries it, as one whose save failed."""
        version = self.optimizer.version + 1
        self.restore(snapshot, version)
        with self.stats.lock:
            self.stats.rollbacks["manual"] += 1
        if self.gate is not None:  # a candidate being scored is dropped; the new weights are scored as the bar
            self.gate.rebaseline(version)
        logger.info("rolled the adapter back to saved version %d (now version %d)", snapshot.version, version)
        if self.checkpointer is None:  # a replica that saves no version: its node's ledger learns it here
            if self.gate is not None:
                self.promoted_snapshot = self.snapshot()
            self._ledger_after_rollback(snapshot.version, version)
            return version, None
        rolled_back = self.snapshot()
        rolled_back.state["rolled_back_to"] = snapshot.version  # a restart applies its fates again (`resume`)
        pair = (snapshot.version, version)
        self._carry_rollbacks(added=(pair,))
        if self.gate is not None:  # what a shutdown saves while a candidate is scored carries it
            self.promoted_snapshot = self.snapshot()
        landed: concurrent.futures.Future = concurrent.futures.Future()

        def saved(saving: concurrent.futures.Future) -> None:
            try:
                landed.set_result(self._rollback_saved(rolled_back, pair, saving.result() is not None))
            except Exception as exc:  # noqa: BLE001 - whoever waits for it hears it
                landed.set_exception(exc)

        with self._carried_lock:  # (the checkpointer's thread counts it down)
            self._rollback_saves_in_flight += 1
        self.checkpointer.save_async(rolled_back).add_done_callback(saved)
        return version, landed

    def rollback_saving(self) -> bool:  # the labels the restored weights hold are let go once it lands
        return self._rollback_saves_in_flight > 0

    def _rollback_saved(self, rolled_back: AdapterSnapshot, pair: tuple[int, int], saved: bool) -> bool:
        """(The checkpointer's thread) saved, its fates follow and it is carried no more."""
        try:
            if not saved:  # its fates follow the weights that serve (a restart before a later save moves them back)
                logger.error("the rollback to version %d (now version %d) serves, but it could not be saved: a "
                             "restart resumes from the last saved version; the next version saved carries it", *pair)
                self._ledger_after_rollback(*pair)
                return False
            self._rollbacks_saved(rolled_back)
            self._ledger_after_rollback(*pair)
            self._carry_rollbacks(removed=(pair,))
            return True
        finally:
            with self._carried_lock:
                self._rollback_saves_in_flight -= 1

    def _save(self, snapshot: AdapterSnapshot) -> None:
        """Saves `snapshot` in the background; once saved, the unsaved rollbacks it carries
        are recorded (`_rollbacks_saved`, on the checkpointer's thread)."""
        future = self.checkpointer.save_async(snapshot)
        if snapshot.state.get("rollbacks"):
            future.add_done_callback(lambda done: done.result() is not None and self._rollbacks_saved(snapshot))

    def _rollbacks_saved(self, snapshot: AdapterSnapshot) -> None:
        """`snapshot` is saved: the rollbacks it carries are carried no more (their fates,
        written when their saves failed, are written again if the ledger lost them)."""
        carried = tuple(tuple(pair) for pair in snapshot.state.get("rollbacks", []))
        for restored, version in carried:
            self._ledger_after_rollback(restored, version)
        self._carry_rollbacks(removed=carried)

    def _carry_rollbacks(self, added: tuple[tuple[int, int], ...] = (),
                         removed: tuple[tuple[int, int], ...] = ()) -> None:
        """The rollbacks every snapshot carries until one is saved (the device thread adds,
        the checkpointer's removes)."""
        with self._carried_lock:
            kept = tuple(pair for pair in self._unsaved_rollbacks if pair not in removed)
            self._unsaved_rollbacks = kept + tuple(pair for pair in added if pair not in kept)

    def _ledger_after_rollback(self, restored: int, version: int) -> None:
        """The ledger's fates after a rollback to `restored`, as `version`: what the versions
        it undid trained is quarantined, what `restored` holds trained (once: nothing again);
        then the queue lets go of the labels those weights hold already."""
        if self.ledger is not None:
            self.ledger.rolled_back(restored, version)
            self._settle_held_again()

    def _settle_held_again(self) -> None:
        """Entries waiting to train again (labels released after a quarantine, or reopened
        by a crash) whose label the weights a rollback restored hold through an earlier
        training: the ledger gave them back `trained`, and trained again they would be in
        the weights twice. They end as trained, into the version that holds them (any
        thread; no job starts here while a rollback's save is on its way: `rollback_saving`)."""
        waiting = [entry.completion_id for entry in self.cache.entries()]
        if not waiting:  # a restart's, before the replay: nothing queued yet
            return
        try:
            self.ledger.flush(strict=True)  # the rollback's fates, read below
            chunks = [tuple(waiting[start:start + 500]) for start in range(0, len(waiting), 500)]
            held = [(row.request.id, row.fate_version, row.fate_path) for chunk in chunks
                    for row in read_ledger(self.ledger.path,
                                           f"r.fate = 'trained' AND r.id IN ({','.join('?' * len(chunk))})", chunk)]
        except (LedgerUnavailable, TimeoutError, sqlite3.Error) as exc:
            logger.warning("the ledger cannot be read or written (%s): labels a rollback gave back their training "
                           "may be trained again", exc)
            return
        for request_id, version, path in held:
            if self.cache.withdraw(request_id, held=(version, path)):
                logger.info("%s is held by the restored weights (its training into version %s): not trained again",
                            request_id, version)
            elif self.cache.get(request_id) is not None:
                logger.warning("%s is being trained while the restored weights hold its training into version "
                               "%s: the weights will hold it twice", request_id, version)

    def save_final(self, candidate_waits: bool = False) -> None:
        """At shutdown (after the engine stopped): saves the final version, if new — the
        promoted one while a candidate is scored, or (`candidate_waits`, replicas) while
        its verdict has not been carried out."""
        if self.checkpointer is not None:
            unjudged = self.gate is not None and (self.gate.pending or candidate_waits)
            final = self.promoted_snapshot if unjudged else self.snapshot()
            if final is not None and self.checkpointer.last_saved_version == final.version:
                final = None
            self.checkpointer.close(final)
            if final is not None and self.checkpointer.last_saved_version == final.version:
                self._rollbacks_saved(final)
