"""Saved adapter versions on disk: one directory per version, in PEFT's format, written atomically.

    DIR/v00000012/adapter_model.safetensors   LoRA weights, PEFT's keys (PeftModel.from_pretrained,
    DIR/v00000012/adapter_config.json         vLLM --lora-modules and TRL load the directory as it is)
    DIR/v00000012/optimizer.pt                AdamW state, so training resumes where it stopped
    DIR/v00000012/alchemist_state.json        version, time, the entries trained into it — written last

A version is written into `DIR/.tmp-…`, every file fsynced, and renamed into place, so a
process killed at any moment (SIGKILL mid-save) leaves either the complete version or a
temporary directory that the next start removes — never a half-written version. A version
pruned is renamed out of place first, then deleted, so that a kill mid-delete leaves no
half-deleted version either; and a directory missing any of the four files is no saved
version (`versions`, `is_saved`) whatever left it so (moved aside at start, as
`vNNNNNNNN.incomplete-<time>`). Loading
checks every file and falls back to the next older version if one is unreadable anyway
(a damaged disk), with a warning. One process at a time writes a directory: it holds a
lock on `DIR/.lock` (released when it ends, by SIGKILL too); a second is refused at start,
as two would number different weights alike and delete each other's saves in progress.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import json
import logging
import os
import re
import shutil
import stat
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file

from trainer import adapter_copies, ledger_lineage
from trainer.adapter_lock import lock_directory
from trainer.ledger_db import LEDGER_FILE
from trainer.version_mark import VersionMark

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "alchemist_state.json"
_VERSION_DIR = re.compile(r"^v(\d{8,})$")
_TMP_PREFIX = ".tmp-"


class AdapterLoadError(Exception):
    """A saved version is missing, incomplete or unreadable."""


class AdapterNotSaved(AdapterLoadError):
    """No saved version has that number (missing, or incomplete: no version)."""


@dataclass
class AdapterSnapshot:
    """Everything needed to resume an adapter: taken on the device thread (tensors cloned
    to CPU), written to disk on another."""
    version: int
    # PEFT state dict: keys as PeftModel.save_pretrained writes them
    weights: dict[str, torch.Tensor]
    # the adapter's peft LoraConfig
    peft_config: object
    optimizer_state: dict
    # training counters and provenance (JSON-serialisable)
    state: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SavedVersion:
    version: int
    path: Path
    # unix time the version was saved
    created: float


class AdapterStore:
    def __init__(self, root: str | Path, keep: int = 5, read_only: bool = False):
        """`read_only`: only load (a server serving a version frozen): it neither creates the
        directory nor clears the temporary directories of saves another process may be writing."""
        self.root = Path(root)
        self.keep = keep
        self.read_only = read_only
        if read_only:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        lock_directory(self.root)
        for leftover in self.root.glob(_TMP_PREFIX + "*"):  # a save or a prune a crash interrupted
            logger.warning("removing what an interrupted adapter save or prune left: %s", leftover)
            shutil.rmtree(leftover, ignore_errors=True)
        for child in self.root.iterdir():  # (left so by a prune before they were renamed first, or by hand)
            if _VERSION_DIR.match(child.name) and not _complete(child):
                aside = child.with_name(f"{child.name}.incomplete-{int(time.time())}")
                logger.warning("moving aside an incomplete adapter version: %s -> %s", child, aside)
                os.rename(child, aside)

    def path_of(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def versions(self) -> list[SavedVersion]:
        """Saved versions, oldest first."""
        saved = []
        try:
            children = list(self.root.iterdir())
        except OSError as exc:  # the directory is gone (a volume unmounted): no version can be loaded from it
            logger.warning("cannot list the adapter directory %s: %s", self.root, exc)
            return []
        for child in children:
            match = _VERSION_DIR.match(child.name)
            with contextlib.suppress(FileNotFoundError):  # (pruned meanwhile)
                if match and _complete(child):
                    saved.append(SavedVersion(int(match.group(1)), child, (child / STATE_FILE).stat().st_mtime))
        return sorted(saved, key=lambda v: v.version)

    def is_saved(self, version: int) -> bool:
        return _complete(self.path_of(version))

    def save(self, snapshot: AdapterSnapshot) -> Path:
        """Writes `snapshot` atomically and prunes versions beyond `keep`; a version that is
        already saved is left as it is."""
        final = self.path_of(snapshot.version)
        if self.is_saved(snapshot.version):
            return final
        # the process's umask decides who may read it (mkdtemp's would be 0700): vLLM or PEFT under another uid
        tmp = self.root / f"{_TMP_PREFIX}v{snapshot.version:08d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(mode=0o777)
        try:
            weights = {k: v.contiguous() for k, v in snapshot.weights.items()}
            save_file(weights, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
            config = copy.deepcopy(snapshot.peft_config)
            config.inference_mode = True
            config.save_pretrained(str(tmp))
            torch.save(snapshot.optimizer_state, tmp / OPTIMIZER_FILE)
            state = {"version": snapshot.version, "saved_at": time.time(), **snapshot.state}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
            os.chmod(tmp / WEIGHTS_FILE, stat.S_IMODE((tmp / STATE_FILE).stat().st_mode))  # safetensors' is 0600
            for name in (WEIGHTS_FILE, CONFIG_FILE, OPTIMIZER_FILE, STATE_FILE):
                _fsync(tmp / name)
            _fsync(tmp)
            if final.exists():  # an incomplete directory of that name, not written by this class
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        return final

    def load(self, version: int) -> AdapterSnapshot:
        from peft import LoraConfig

        path = self.path_of(version)
        if not _complete(path):
            raise AdapterNotSaved(f"{path}: no saved version")
        try:
            state = json.loads((path / STATE_FILE).read_text())
            if state.get("version") != version:
                raise AdapterLoadError(f"{path}: {STATE_FILE} says version {state.get('version')}")
            weights = load_file(path / WEIGHTS_FILE)
            peft_config = LoraConfig.from_pretrained(str(path))
            optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        except AdapterLoadError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unreadable file makes the version unusable
            raise AdapterLoadError(f"{path}: {type(exc).__name__}: {exc}") from exc
        for name, tensor in weights.items():
            if not torch.isfinite(tensor).all():
                raise AdapterLoadError(f"{path}: {name} holds non-finite values")
        return AdapterSnapshot(version, weights, peft_config, optimizer_state,
                               {k: v for k, v in state.items() if k not in ("version", "saved_at")})

    def latest(self) -> AdapterSnapshot | None:
        """The newest version that loads (older ones are tried in turn); None if none does.
        One that does not load is moved aside (`vNNNNNNNN.unreadable-<time>`, kept to look at), so
        that the version trained again under its number is saved."""
        for saved in reversed(self.versions()):
            try:
                return self.load(saved.version)
            except AdapterLoadError as exc:
                aside = ""
                if not self.read_only:
                    aside = saved.path.with_name(f"{saved.path.name}.unreadable-{int(time.time())}")
                    os.rename(saved.path, aside)
                logger.warning("skipping saved adapter version %d: %s%s", saved.version, exc,
                               f" (moved to {aside})" if aside else "")
        return None

    def _prune(self) -> None:
        """Keeps the newest `keep` versions, copies of the same weights going first
        (trainer/adapter_copies.py)."""
        saved = {version.version: version for version in self.versions()}
        for number in adapter_copies.prunable(self._copies(saved.values()), self.keep):
            self._delete(saved[number].path)

    def holder_of(self, version: int) -> int:
        """The saved version holding `version`'s weights: itself, a copy of it where it was
        pruned for one, or what it copied where it was a copy pruned (trainer/adapter_copies.py;
        the ledger in the directory remembers what pruned copies copied)."""
        copied_before = ledger_lineage.copied_versions(self.root / LEDGER_FILE)
        return adapter_copies.holder_of(self._copies(self.versions()), version, copied_before)

    @staticmethod
    def _copies(saved) -> dict[int, int | None]:
        return {version.version: _weights_of(version) for version in saved}

    def _delete(self, path: Path) -> None:
        """Deletes a version's directory: renamed out of place first (the next start
        removes what a kill leaves of it), so that no half-deleted version is ever listed."""
        doomed = self.root / f"{_TMP_PREFIX}pruned-{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, doomed)
            _fsync(self.root)
        except OSError as exc:
            logger.warning("cannot prune the adapter version %s: %s", path, exc)
            return
        shutil.rmtree(doomed, ignore_errors=True)


def _complete(path: Path) -> bool:
    """A version directory holding every file a save writes."""
    return all((path / name).is_file() for name in (WEIGHTS_FILE, CONFIG_FILE, OPTIMIZER_FILE, STATE_FILE))


def _weights_of(saved: SavedVersion) -> int | None:
    """The version whose weights `saved` copies (a rollback's, the gate's), if it says so."""
    try:
        state = json.loads((saved.path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state.get("weights_of", state.get("rolled_back_to", state.get("copy_of")))


def _tensor_bytes(value) -> int:
    """Bytes of the tensors in `value` (nested dicts and lists, as an optimizer's state)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return sum(_tensor_bytes(item) for item in items)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SaveRefused(Exception):
    """A journal refused a save: what the version trained is not known to be kept (the next may be)."""


class SaveJournal(Protocol):
    """What keeps account of the labels a saved version holds (trainer/ledger.py)."""

    def before_save(self, snapshot: AdapterSnapshot) -> None:
        """What `snapshot`'s version trained is on disk before it is; raises if it cannot be (the save fails)."""

    def saved(self, version: int) -> None:
        """Version `version` is on disk."""

    def resumed(self, saved: int, version: int) -> None:
        """Training resumes from saved version `saved` (-1: none) as `version`; those after it died unsaved."""


class AdapterCheckpointer:
    """When to save: every `save_every` versions and on demand. Snapshots are taken by the
    caller on the device thread; the disk writes run on a writer thread of their own, one
    at a time, so serving never waits for the disk."""

    def __init__(self, store: AdapterStore, save_every: int, journal: SaveJournal | None = None):
        """`journal` (the feedback ledger): told on the writer thread before each version is written, and after."""
        self.store = store
        self.save_every = save_every
        self.journal = journal
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="alchemist-adapter-save")
        self._pending: list[concurrent.futures.Future] = []
        self.saved = 0
        self.failed = 0
        self.last_saved_version: int | None = None
        # the version numbers given out (trainer/version_mark.py): a restart gives none of them again
        self.mark = VersionMark(store.root)

    def resumed(self, saved: int | None, version: int) -> None:
        """Training resumes from saved version `saved` (None: none is saved yet) as `version`."""
        self.last_saved_version = saved
        if self.journal is not None:
            self.journal.resumed(-1 if saved is None else saved, version)

    def due(self, version: int) -> bool:
        return version % self.save_every == 0

    def save_async(self, snapshot: AdapterSnapshot) -> concurrent.futures.Future:
        self._pending = [f for f in self._pending if not f.done()]
        future = self._writer.submit(self._save, snapshot)
        self._pending.append(future)
        return future

    def _save(self, snapshot: AdapterSnapshot) -> Path | None:
        if self.store.is_saved(snapshot.version):  # (at shutdown, a version saved before or resumed from)
            self.last_saved_version = snapshot.version
            return self.store.path_of(snapshot.version)
        try:
            if self.journal is not None:
                self.journal.before_save(snapshot)
            path = self.store.save(snapshot)
        except SaveRefused as exc:
            self.failed += 1
            logger.warning("adapter version %d is not saved: %s", snapshot.version, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - a failed save is counted; the next one may succeed
            self.failed += 1
            short = self._short_of_room(snapshot)  # (torch's writer says "unexpected pos", not that the disk is full)
            logger.log(logging.WARNING if short else logging.ERROR, "saving adapter version %d failed: %s%s",
                       snapshot.version, exc, f" ({short})" if short else "",
                       exc_info=not short or logger.isEnabledFor(logging.DEBUG))
            return None
        self.saved += 1
        self.last_saved_version = snapshot.version
        if self.journal is not None:
            self.journal.saved(snapshot.version)
        logger.info("saved adapter version %d to %s", snapshot.version, path)
        return path

    def _short_of_room(self, snapshot: AdapterSnapshot) -> str | None:
        """What a failed save says of the disk, where it has less room than `snapshot` takes."""
        needed = _tensor_bytes([snapshot.weights, snapshot.optimizer_state])
        try:
            free = shutil.disk_usage(self.store.root).free
        except OSError:  # (the directory gone)
            return None
        return None if free >= needed else (f"the disk holds {free / 2**20:.1f} MiB free, this version takes "
                                            f"{needed / 2**20:.1f} MiB (room for adapter.keep versions and one more)")

    def wait(self) -> None:
        for future in list(self._pending):
            future.result()

    def close(self, final: AdapterSnapshot | None = None) -> None:
        """Finishes pending saves, then saves `final` (the adapter at shutdown)."""
        self.wait()
        if final is not None:
            self._save(final)
        self._writer.shutdown(wait=True)
        self.mark.close()


class AdapterMismatchError(ValueError):
    """A saved adapter does not fit the configured one (rank, alpha, target modules)."""


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
