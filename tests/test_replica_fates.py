"""Among replicas, rank 0 saves a version only once every replica's ledger holds the fates
of the labels trained into it (trainer/replica_fates.py): otherwise a `kill -9` of another
replica just after the save loses its fates, and the restart trains its labels a second
time into weights that already hold them.

The pieces, then the rounds over gloo in two processes: rank 0's save waits for the other
replica's fates; once that replica dies, what it did not confirm is not saved.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.launch import free_port
from tests.servers import wait_for
from tests.test_ledger_durability import training_that_saves
from tests.test_replicas import adapter_params, rounds_with
from trainer.adapter_store import AdapterSnapshot
from trainer.ledger import Ledger
from trainer.ledger_db import BUSY_TIMEOUT_S, LEDGER_FILE
from trainer.replica_fates import FateWatermarks, FatesUnconfirmed, ReplicatedSaveJournal
from trainer.replicated import CombinedStep, ReplicaSync


def _snapshot(version: int, **state) -> AdapterSnapshot:
    return AdapterSnapshot(version, {}, None, {}, state)


def _returns_within(call, seconds: float) -> bool:
    """Whether `call()` returned (rather than still waiting) within `seconds`."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


# -- the pieces ------------------------------------------------------------------------------


def test_a_save_waits_until_every_replicas_fates_through_its_version_are_heard():
    fates = FateWatermarks(3)
    journal = ReplicatedSaveJournal(fates, None, timeout_s=30)
    journal.before_save(_snapshot(3))  # the version every replica started from
    assert not _returns_within(lambda: journal.before_save(_snapshot(5)), 0.3)
    fates.heard(4)
    assert not _returns_within(lambda: journal.before_save(_snapshot(5)), 0.3)
    waiting = threading.Thread(target=journal.before_save, args=(_snapshot(5),))
    waiting.start()
    fates.heard(5)
    waiting.join(5)
    assert not waiting.is_alive()


def test_a_rollbacks_save_needs_the_fates_of_the_versions_before_it_only():
    """A restart that resumes from a rollback applies its fates again: what must be
    committed first is what the versions before it trained."""
    fates = FateWatermarks(6)
    ReplicatedSaveJournal(fates, None, timeout_s=0.2).before_save(_snapshot(7, rolled_back_to=2))
    with pytest.raises(FatesUnconfirmed):
        ReplicatedSaveJournal(fates, None, timeout_s=0.2).before_save(_snapshot(7))


def test_once_the_rounds_failed_what_they_did_not_confirm_is_not_saved():
    fates = FateWatermarks(2)
    journal = ReplicatedSaveJournal(fates, None, timeout_s=30)
    fates.stop(failed=True)
    journal.before_save(_snapshot(2))  # confirmed before the failure
    with pytest.raises(FatesUnconfirmed, match="rounds failed"):
        journal.before_save(_snapshot(3))


def test_a_shutdown_the_replicas_agreed_on_saves_as_a_single_server_does():
    fates = FateWatermarks(2)
    journal = ReplicatedSaveJournal(fates, None, timeout_s=30)
    waiting = threading.Thread(target=journal.before_save, args=(_snapshot(4),))
    waiting.start()
    fates.stop(failed=False)
    waiting.join(5)
    assert not waiting.is_alive()


def test_a_ledger_marker_is_heard_once_the_fates_before_it_are_committed_not_while_they_wait_to_be_retried(tmp_path):
    ledger = Ledger(tmp_path / LEDGER_FILE)
    heard = []
    ledger.when_written(lambda: heard.append("nothing owed"))
    ledger.flush()
    assert heard == ["nothing owed"]
    blocker = sqlite3.connect(tmp_path / LEDGER_FILE, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        ledger.record_fate("r0", "trained", version=1, path="reuse")  # waits behind the lock, then for its retry
        ledger.when_written(lambda: heard.append("fates of version 1"))
        ledger.flush(timeout_s=3 * BUSY_TIMEOUT_S)
        assert heard == ["nothing owed"]
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    ledger.when_written(lambda: heard.append("after the retry"))
    ledger.flush()
    assert heard == ["nothing owed", "fates of version 1", "after the retry"]  # retried with its fates
    ledger.close()


def test_a_replica_reports_a_version_once_its_ledger_has_committed_what_it_queued_before(tmp_path):
    """The device thread applies a round's step, then queues a marker behind the fates it
    wrote: the rounds hear the version only once the ledger has committed them."""
    training = training_that_saves(tmp_path, save_every=1000)
    params = training.optimizer.params
    others = CombinedStep(torch.cat([torch.zeros(p.numel()) for p in params]), entries=1, finite=True, mine=False)
    sync = rounds_with(params, [others])
    training.replicas = training.trainer.replicas = sync
    blocker = sqlite3.connect(tmp_path / LEDGER_FILE, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        assert training.apply_synced() and training.optimizer.version == 1
        training.ledger.flush(timeout_s=3 * BUSY_TIMEOUT_S)
        assert sync.fates.mine == 0
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    training.ledger.flush()
    assert sync.fates.mine == 1
    training.replicas = training.trainer.replicas = None
    training.close()


# -- the rounds over gloo --------------------------------------------------------------------


def _save_waits_main(rank: int, world_size: int, port: int, out: str) -> None:
    """Both replicas applied version 1. Rank 1's fates for it land a second later; rank
    0's save of version 1 waits for them. Then rank 1 dies without a word, and rank 0
    refuses to save version 2, which rank 1 never confirmed."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    signal.signal(signal.SIGTERM, lambda *_: None)  # a replica leaving the group signals itself (uvicorn's, here)
    sync = ReplicaSync(adapter_params(seed=rank), rank, round_interval_s=0.01, round_timeout_s=20)
    sync.start(0)
    results = Path(out)
    if rank == 1:
        time.sleep(1.0)
        (results / "rank1-written").write_text(str(time.time()))
        sync.fates.written(1)
        wait_for((results / "rank0-saved-1").is_file, timeout=60)
        os._exit(0)  # as `kill -9` would: no last round
    sync.fates.written(2)  # rank 0 applied two versions and wrote their fates
    journal = ReplicatedSaveJournal(sync.fates, None, timeout_s=30)
    journal.before_save(_snapshot(1))
    saved_1 = time.time()
    (results / "rank0-saved-1").write_text(str(saved_1))
    try:
        journal.before_save(_snapshot(2))
        refused = None
    except FatesUnconfirmed as exc:
        refused = str(exc)
    (results / "rank0.json").write_text(json.dumps({"saved_1": saved_1, "refused": refused,
                                                    "everywhere": sync.fates.everywhere}))
    os._exit(0)


def test_rank_0_saves_a_version_after_the_other_replicas_fates_and_not_what_a_dead_replica_left_unconfirmed(tmp_path):
    mp.start_processes(_save_waits_main, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["saved_1"] >= float((tmp_path / "rank1-written").read_text())
    assert result["everywhere"] == 1 and "rounds failed" in result["refused"]
