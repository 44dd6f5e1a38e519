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
from tests.conftest import make_training
from tests.servers import wait_for
from tests.test_ledger import DPO, rows_by_id
from tests.test_ledger_durability import LABEL, training_that_saves
from tests.test_replicas import adapter_params, rounds_with
from trainer.adapter_store import AdapterSnapshot
from trainer.ledger import Ledger
from trainer.ledger_db import LEDGER_FILE
from trainer.ledger_file import BUSY_TIMEOUT_S
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


def test_a_rollbacks_save_needs_the_fates_of_every_version_it_undid_and_not_its_own():
    """A restart that resumes from a rollback applies its fates again, quarantining what
    the versions it undid trained: those fates must be on disk first (a label whose fate a
    kill lost would train again); the rollback's own are applied again by that restart."""
    fates = FateWatermarks(5)
    with pytest.raises(FatesUnconfirmed):  # version 6, undone, is not confirmed everywhere
        ReplicatedSaveJournal(fates, None, timeout_s=0.2).before_save(_snapshot(7, rolled_back_to=2))
    fates.heard(6)
    ReplicatedSaveJournal(fates, None, timeout_s=0.2).before_save(_snapshot(7, rolled_back_to=2))
    with pytest.raises(FatesUnconfirmed):
        ReplicatedSaveJournal(fates, None, timeout_s=0.2).before_save(_snapshot(7))


def test_once_the_rounds_failed_what_they_did_not_confirm_is_not_saved():
    fates = FateWatermarks(2)
    journal = ReplicatedSaveJournal(fates, None, timeout_s=30)
    fates.settle(failed=True)
    journal.before_save(_snapshot(2))  # confirmed before the failure
    with pytest.raises(FatesUnconfirmed, match="rounds failed"):
        journal.before_save(_snapshot(3))


def test_at_a_shutdown_a_waiting_save_goes_once_the_last_word_confirms_it_and_not_otherwise():
    fates = FateWatermarks(2)
    journal = ReplicatedSaveJournal(fates, None, timeout_s=30)
    waiting = threading.Thread(target=journal.before_save, args=(_snapshot(4),))
    waiting.start()
    time.sleep(0.2)
    assert waiting.is_alive()  # the rounds are over, the last word not yet heard
    fates.heard(4)  # the last word
    fates.settle()
    waiting.join(5)
    assert not waiting.is_alive()
    with pytest.raises(FatesUnconfirmed, match="rounds ended"):
        journal.before_save(_snapshot(5))


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


def test_a_marker_behind_a_fate_a_full_ledger_refused_is_heard_once_that_fate_lands(tmp_path, monkeypatch):
    """A full ledger tries each write alone: the fate fails and waits for its retry, the
    marker behind it commits at once; it must wait with the fate, not be lost (a review
    found it lost: the replica's saves then stalled until its next step)."""
    from trainer import ledger_lineage

    full = [True]
    plain_record_fate = ledger_lineage.record_fate

    def record_fate(*args):
        if full[0]:
            error = sqlite3.OperationalError("database or disk is full")
            error.sqlite_errorcode = sqlite3.SQLITE_FULL
            raise error
        return plain_record_fate(*args)

    monkeypatch.setattr(ledger_lineage, "record_fate", record_fate)
    ledger, heard = Ledger(tmp_path / LEDGER_FILE), []
    ledger.record_fate("r0", "trained", version=1, path="reuse")
    ledger.when_written(lambda: heard.append("version 1"))
    ledger.flush()
    assert heard == []
    full[0] = False
    ledger.flush()  # the next writes bring the retries with them
    assert heard == ["version 1"]
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


def test_the_rollbacks_rank_0s_start_applied_again_are_applied_again_in_every_other_nodes_ledger(tmp_path):
    """A rollback's save waits only for what the version it restored holds: its own fates
    are applied again by the restart that resumes from it — in rank 0's ledger, and now in
    another node's too, which a kill may have left without them."""
    from tests.test_ledger import crash, request_record, serve_and_label

    (tmp_path / "node0").mkdir()
    first = training_that_saves(tmp_path / "node0", save_every=1)
    serve_and_label(first, ("r",), train_each=True)
    first.ledger.rolled_back = lambda *args: None  # killed before the rollback's fates landed
    assert first.rollback(first.lifecycle.load_saved(0)) == 2
    crash(first)
    rank0 = training_that_saves(tmp_path / "node0", save_every=1)
    adopted = rank0.lifecycle.adoptable()
    assert adopted.state["rollbacks_replayed"] == [[0, 2]]
    other_node = tmp_path / "node1"
    other_node.mkdir()
    ledger = Ledger(other_node / LEDGER_FILE)
    replica = make_training(DPO, ledger=ledger)  # (adopting comes before the replay in a start: here, after)
    ledger.record_request(request_record(7, time.time()))
    ledger.commit_label("req-7", LABEL)
    ledger.record_fate("req-7", "trained", version=1, path="reuse")  # trained there into the version undone
    replica.lifecycle.adopted(adopted)
    ledger.flush()
    assert rows_by_id(other_node / LEDGER_FILE)["req-7"].fate == "quarantined"
    replica.close()
    rank0.close()


def test_at_shutdown_a_replica_has_its_last_word_after_the_fates_of_the_steps_it_applied_last(tmp_path):
    training = training_that_saves(tmp_path, save_every=1000)
    params = training.optimizer.params
    others = CombinedStep(torch.cat([torch.zeros(p.numel()) for p in params]), entries=1, finite=True, mine=False)
    sync = rounds_with(params, [others])
    said = []
    sync.last_word = lambda: said.append(sync.fates.mine)
    training.replicas = training.trainer.replicas = sync
    training.close()
    assert training.optimizer.version == 1 and said == [1]


# -- the rounds over gloo --------------------------------------------------------------------


def _save_waits_main(rank: int, world_size: int, port: int, out: str, ends: str) -> None:
    """Both replicas applied version 1. Rank 1's fates for it land a second later; rank
    0's save of version 1 waits for them. Then rank 1 ends — killed, or leaving the group
    (a result it could not apply), which stops the rounds as a shutdown does — and rank 0
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
        if ends == "leaves":
            sync.leave("it could not apply a round's step")
            sync.close()
        os._exit(0)  # (killed: as `kill -9` would, no last round)
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


@pytest.mark.parametrize("ends", ["killed", "leaves"])
def test_rank_0_saves_a_version_after_the_other_replicas_fates_and_not_what_a_lost_replica_left_unconfirmed(
        tmp_path, ends):
    mp.start_processes(_save_waits_main, args=(2, free_port(), str(tmp_path), ends), nprocs=2, start_method="spawn")
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["saved_1"] >= float((tmp_path / "rank1-written").read_text())
    assert result["everywhere"] == 1 and "rounds failed" in result["refused"]


def _last_word_main(rank: int, world_size: int, port: int, out: str, rank1: str, late: int | None) -> None:
    """Both replicas shut down as agreed — at once, or one (`late`) a second after the other,
    as replicas draining their requests apart do: the rounds end, then each applies their
    last step (version 2) and has the last word. Rank 1's ledger committed that step's
    fates (`confirmed`), or could not (`unconfirmed`), or rank 1 is not shutting down and
    says nothing (`silent`): rank 0 saves version 2 in the first case only."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    sync = ReplicaSync(adapter_params(seed=rank), rank, round_interval_s=0.01, last_word_timeout_s=10)
    sync.start(1)
    results = Path(out)
    if rank == 1 and rank1 == "silent":
        wait_for((results / "rank0.json").is_file, timeout=60)
        os._exit(0)
    if rank == 0:
        journal = ReplicatedSaveJournal(sync.fates, None, timeout_s=30)
        saving = []
        waiting = threading.Thread(target=lambda: saving.append(_refusal(journal, 2)))
        waiting.start()  # a due save, begun before the shutdown
    if rank == late:
        time.sleep(1.0)  # the other's stop has ended the rounds meanwhile
    sync.close()  # the agreed stop: its last round
    if rank == 0 or rank1 == "confirmed":
        sync.fates.written(2)  # the last step applied after the last round, its fates committed
    sync.last_word()
    if rank == 0:
        waiting.join(30)
        (results / "rank0.json").write_text(json.dumps({"refused": saving[0], "everywhere": sync.fates.everywhere}))
    os._exit(0)


def _refusal(journal: ReplicatedSaveJournal, version: int) -> str | None:
    try:
        journal.before_save(_snapshot(version))
    except FatesUnconfirmed as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("rank1, late", [("confirmed", None), ("confirmed", 0), ("confirmed", 1),
                                         ("unconfirmed", None), ("silent", None)])
def test_at_an_agreed_shutdown_rank_0_saves_what_every_replicas_last_word_confirms(tmp_path, rank1, late):
    """(A review found the staggered shutdowns refused: a replica stopped by another's stop
    had settled before its own last word.)"""
    mp.start_processes(_last_word_main, args=(2, free_port(), str(tmp_path), rank1, late), nprocs=2,
                       start_method="spawn")
    result = json.loads((tmp_path / "rank0.json").read_text())
    if rank1 == "confirmed":
        assert result == {"refused": None, "everywhere": 2}
    else:
        assert result["everywhere"] == 1 and "not saved" in result["refused"]


def _wired_main(rank: int, world_size: int, port: int, out: str) -> None:
    """A server's training built as one replica of a group of one: its versions are saved
    through the rounds' watermark, and saved they are."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from tests.test_training import label, serve
    from trainer.adapter_store import AdapterCheckpointer, AdapterStore
    from trainer.replicated import Replica

    ledger = Ledger(Path(out) / LEDGER_FILE)
    training = make_training(DPO, ledger=ledger, checkpointer=AdapterCheckpointer(AdapterStore(out), 1, ledger),
                             replica=Replica(rank, world_size))
    serve(training, "chatcmpl-r0-a")
    label(training, "chatcmpl-r0-a")
    deadline = time.time() + 120
    while training.optimizer.version < 1 or training.lifecycle.checkpointer.last_saved_version != 1:
        assert time.time() < deadline, "version 1 was not saved"
        training.run_slice() or time.sleep(0.02)
    journal = training.lifecycle.checkpointer.journal
    Path(out, "wired.json").write_text(json.dumps({"journal": type(journal).__name__,
                                                   "everywhere": training.replicas.fates.everywhere}))
    training.close()
    dist.destroy_process_group()


def test_a_replicas_versions_are_saved_through_the_watermark_and_saved_they_are(tmp_path):
    mp.spawn(_wired_main, args=(1, free_port(), str(tmp_path)), nprocs=1, join=True)
    assert json.loads((tmp_path / "wired.json").read_text()) == {"journal": "ReplicatedSaveJournal", "everywhere": 1}
