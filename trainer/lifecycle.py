"""The adapter's lifecycle: what becomes of a new version (merged serving weights
rebuilt, saved every `save_every` versions), and the adapter on disk — resume, snapshot,
rollback, and the compatibility check between a saved adapter and the configured one.

Everything here runs on the device thread (weights change between steps, never under
one). A rollback abandons the job in progress first; that is the caller's
(`OnlineTraining.rollback`), since the job belongs to the trainer.
"""

from __future__ import annotations

import logging

import torch

from trainer.adapter_store import AdapterCheckpointer, AdapterSnapshot, SavedVersion
from trainer.cache import ActivationCache
from trainer.maintenance import Maintenance
from trainer.optimizer import AdapterOptimizer
from trainer.stash import WeightStash
from trainer.status import TrainingStats

logger = logging.getLogger(__name__)


class AdapterMismatchError(ValueError):
    """A saved adapter does not fit the configured one (rank, alpha, target modules)."""


class AdapterLifecycle:
    def __init__(self, peft_model, optimizer: AdapterOptimizer, cache: ActivationCache, stash: WeightStash,
                 maintenance: Maintenance, stats: TrainingStats, mode: str,
                 checkpointer: AdapterCheckpointer | None = None):
        """`checkpointer`: saves versions to the adapter directory (None: none is set)."""
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

    def start(self) -> None:
        """Resumes from the latest good saved version, if any (else saves version 0, so
        there is always a version to roll back to). Call before serving starts."""
        if self.checkpointer is None:
            return
        snapshot = self.checkpointer.store.latest()
        if snapshot is not None:
            self.restore(snapshot, snapshot.version)
            self.maintenance.merge_all()
            logger.info("resumed adapter version %d from %s", snapshot.version, self.checkpointer.store.root)
        else:
            self.checkpointer.save_async(self.snapshot()).result()

    def after_step(self, stepped: bool) -> None:
        """An optimizer step ran (`stepped`: it changed the weights): merged serving
        weights go stale, and the version is saved if one is due."""
        if stepped and self.checkpointer is not None and self.checkpointer.due(self.optimizer.version):
            self.checkpointer.save_async(self.snapshot())
        self.maintenance.invalidate_merged()

    def saved_versions(self) -> list[SavedVersion]:
        """The versions on disk, oldest first (none without an adapter directory)."""
        return self.checkpointer.store.versions() if self.checkpointer is not None else []

    def load_saved(self, version: int) -> AdapterSnapshot:
        """Reads a saved version (disk I/O: call off the event loop); AdapterLoadError."""
        return self.checkpointer.store.load(version)

    def snapshot(self) -> AdapterSnapshot:
        from peft import get_peft_model_state_dict

        weights = {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(self.peft_model).items()}
        stats = self.stats.copy()
        return AdapterSnapshot(self.optimizer.version, weights, self.peft_model.peft_config["default"],
                               self.optimizer.state_dict(),
                               {"mode": self.mode, "restored_from": self.restored_from,
                                "trained_entries": sum(stats.trained_entries.values()),
                                "train_tokens": stats.train_tokens})

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
        self.optimizer.load_state_dict(snapshot.optimizer_state, version)
        self.cache.release_stale(version)
        self.stash.release_except(self.cache.recorded_versions())
        self.restored_from = snapshot.version
        self.maintenance.invalidate_merged()

    def rollback(self, snapshot: AdapterSnapshot) -> int:
        """Makes the saved `snapshot` the live adapter. Versions only go forward: the
        rolled-back adapter is a new version (saved at once), so nothing recorded under
        the weights being replaced is mistaken for current."""
        version = self.optimizer.version + 1
        self.restore(snapshot, version)
        if self.checkpointer is not None:
            self.checkpointer.save_async(self.snapshot())
        logger.info("rolled the adapter back to saved version %d (now version %d)", snapshot.version, version)
        return version

    def save_final(self) -> None:
        """At shutdown (after the engine stopped): saves the final version, if new."""
        if self.checkpointer is not None:
            final = self.snapshot() if self.checkpointer.last_saved_version != self.optimizer.version else None
            self.checkpointer.close(final)


def check_compatible(ours, snapshot: AdapterSnapshot, live: dict) -> None:
    """Raises AdapterMismatchError if `snapshot` cannot be loaded into the live adapter
    (`ours`: its LoraConfig, `live`: its state dict)."""
    theirs = snapshot.peft_config
    problems = [f"{name} {getattr(theirs, name)} (configured: {getattr(ours, name)})"
                for name in ("r", "lora_alpha") if getattr(theirs, name) != getattr(ours, name)]
    if set(theirs.target_modules or ()) != set(ours.target_modules or ()):
        problems.append(f"target modules {sorted(theirs.target_modules)} (configured: "
                        f"{sorted(ours.target_modules)})")
    if not problems:
        if set(snapshot.weights) != set(live):
            problems.append("its weights name other layers")
        else:
            problems += [f"{k} has shape {tuple(snapshot.weights[k].shape)}, expected {tuple(v.shape)}"
                         for k, v in live.items() if snapshot.weights[k].shape != v.shape]
    if problems:
        raise AdapterMismatchError(f"saved adapter version {snapshot.version} does not fit this model and "
                                   f"configuration: {'; '.join(problems[:3])}. Use another adapter directory "
                                   "or match the configuration.")
