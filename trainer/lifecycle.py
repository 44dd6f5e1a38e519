"""The adapter's lifecycle on disk: snapshot, resume, rollback, and the compatibility
check between a saved adapter and the configured one.

`AdapterLifecycle` is a part of `Trainer` (trainer/trainer.py), kept in its own file: it
uses the trainer's `peft_model`, `optimizer`, `cache`, `stats`, `mode`, `checkpointer`
and `restored_from`, and its `abandon_job()` and `invalidate_merged()`. Everything here
runs on the device thread (weights change between steps, never under one).
"""

from __future__ import annotations

import logging

import torch

from trainer.adapter_store import AdapterCheckpointer, AdapterSnapshot, SavedVersion

logger = logging.getLogger(__name__)


class AdapterMismatchError(ValueError):
    """A saved adapter does not fit the configured one (rank, alpha, target modules)."""


class AdapterLifecycle:
    def enable_checkpoints(self, checkpointer: AdapterCheckpointer) -> None:
        """Resumes from the latest good saved version, if any (else saves version 0, so
        there is always a version to roll back to); from then on saves every
        `save_every` versions. Call before serving starts."""
        snapshot = checkpointer.store.latest()
        if snapshot is not None:
            self.restore(snapshot, snapshot.version)
            self.merge_all()
            logger.info("resumed adapter version %d from %s", snapshot.version, checkpointer.store.root)
        else:
            checkpointer.save_async(self.snapshot()).result()
        self.checkpointer = checkpointer

    def saved_versions(self) -> list[SavedVersion]:
        """The versions on disk, oldest first (none without an adapter directory)."""
        return self.checkpointer.store.versions() if self.checkpointer is not None else []

    def load_saved(self, version: int) -> AdapterSnapshot:
        """Reads a saved version (disk I/O: call off the event loop); AdapterLoadError."""
        return self.checkpointer.store.load(version)

    def snapshot(self) -> AdapterSnapshot:
        from peft import get_peft_model_state_dict

        weights = {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(self.peft_model).items()}
        trained = sum(self.stats.trained_entries.values())
        return AdapterSnapshot(self.optimizer.version, weights, self.peft_model.peft_config["default"],
                               self.optimizer.state_dict(),
                               {"mode": self.mode, "restored_from": self.restored_from,
                                "trained_entries": trained, "train_tokens": self.stats.train_tokens})

    def restore(self, snapshot: AdapterSnapshot, version: int) -> None:
        """Loads `snapshot` into the live adapter as adapter `version`. A job in progress is
        abandoned: its gradients are discarded and its entries go back in line (recorded
        under other weights, they take the recompute path)."""
        from peft import get_peft_model_state_dict

        live = get_peft_model_state_dict(self.peft_model)
        check_compatible(self.peft_model.peft_config["default"], snapshot, live)
        self.abandon_job()
        with torch.no_grad():
            for name, tensor in live.items():
                tensor.copy_(snapshot.weights[name])
        self.optimizer.load_state_dict(snapshot.optimizer_state, version)
        self.cache.release_stale(version)
        self.release_unneeded_weights()
        self.restored_from = snapshot.version
        self.invalidate_merged()

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
