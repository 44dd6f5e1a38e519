"""What a kill -9 must not take from the feedback ledger, at the edges of a restart: labels
past `max_label_entries`, a gate's copy whose save the kill cut short, fates still waiting
for their retry when a version is saved, and labels trained into a version not saved yet
when retention runs."""

import dataclasses
import sqlite3
import time

import pytest

from tests.conftest import make_training
from tests.test_ledger import request_record, rows_by_id
from tests.test_training import label, serve
from trainer.adapter_store import AdapterCheckpointer, AdapterStore
from trainer.config import LedgerConfig, TrainConfig
from trainer.ledger import Ledger, LedgerUnavailable
from trainer.label_history import remembered
from trainer.ledger_db import LEDGER_FILE, ChoiceRecord, LabelRecord, deleted_requests, read_ledger, release_quarantined
from trainer.ledger_lineage import lineage
from trainer.ledger_write import QueuedWrite, RetryBacklog

DPO = TrainConfig(mode="dpo", lora_rank=4)
LABEL = LabelRecord("preference", chosen="yes", chosen_token_ids=[1], rejected_token_ids=[2])


def training_that_saves(root, config: TrainConfig = DPO, save_every: int = 10):
    """Training on `root` wired as a server wires it (server/build.py: the ledger is the
    checkpointer's journal)."""
    ledger = Ledger(root / LEDGER_FILE)
    return make_training(config, checkpointer=AdapterCheckpointer(AdapterStore(root), save_every, ledger),
                         ledger=ledger)


def _kill(training) -> None:
    """What a kill leaves: the ledger's queued writes landed, nothing saved at exit."""
    training.ledger.flush()
    training.ledger.close()
    training.lifecycle.checkpointer.wait()


def test_a_restart_trains_every_label_answered_200_past_the_bound_on_label_entries(tmp_path):
    """Labelled recordings do not count against `max_label_entries` while the server
    lives; the restart takes them back without activations, and the bound must not
    refuse — and drop for good — labels the server had accepted."""
    config = dataclasses.replace(DPO, max_label_entries=1)
    first = training_that_saves(tmp_path, config)
    for i in range(3):
        serve(first, f"r{i}")
        label(first, f"r{i}")
    assert first.cache.label_entries == 0
    _kill(first)
    second = training_that_saves(tmp_path, config)
    assert {second.cache.get(f"r{i}").state.value for i in range(3)} == {"ready"}
    assert second.cache.refused_label_entries == 0
    second.train_until_idle()
    assert second.stats.copy().trained_entries == {("dpo", "recompute"): 3}
    second.ledger.flush()
    assert {row.fate for row in read_ledger(tmp_path / LEDGER_FILE)} == {"trained"}
    second.close()


def test_a_gate_copy_whose_save_a_kill_cut_short_is_forgotten_and_its_number_not_given_again(tmp_path):
    """The gate's rejection records version 5 as a copy of version 0 before 5 is saved; a
    kill then resumes version 0's weights, as version 6: the restart forgets 5's parent,
    and the new weights take a number after it."""
    first = training_that_saves(tmp_path)
    serve(first, "a")
    label(first, "a")
    first.ledger.quarantine(["a"], "eval gate rejected version 4", 5, 0)
    _kill(first)  # before version 5 was written
    second = training_that_saves(tmp_path)
    assert second.lifecycle.restored_from == 0 and second.optimizer.version == 6
    second.ledger.flush()
    with sqlite3.connect(tmp_path / LEDGER_FILE) as conn:
        assert lineage(conn, 5) == [(0, 5)] and lineage(conn, 6) == [(6, 6), (0, 0)]
    second.close()


def test_a_restart_never_gives_a_number_that_served_or_trained_to_other_weights(tmp_path):
    """Versions after the last saved one die with a kill (an outside pass: saved every 4,
    versions 13 and 14 served, a restart at 12 served other weights as 13 and 14, and the
    ledger's requests of "version 13" came from two adapters). The saved weights come back
    under the next number after every one the ledger knows; their lineage skips the lost
    versions, whose labels train again; and so on through another kill."""
    first = training_that_saves(tmp_path, save_every=4)
    serve(first, "r0")
    label(first, "r0")
    first.train_until_idle()
    assert first.optimizer.version == 1
    serve(first, "r1")  # served by version 1, which no save holds
    _kill(first)
    second = training_that_saves(tmp_path, save_every=4)
    assert second.lifecycle.restored_from == 0 and second.optimizer.version == 2
    assert second.cache.get("r0").state.value == "ready"  # trained into the lost version 1: trains again
    serve(second, "r2")
    second.ledger.flush()
    assert {r.request.id: r.request.adapter_version for r in read_ledger(tmp_path / LEDGER_FILE)} == {
        "r0": 0, "r1": 1, "r2": 2}
    with sqlite3.connect(tmp_path / LEDGER_FILE) as conn:
        assert lineage(conn, 2) == [(2, 2), (0, 0)]  # version 1's labels are not in these weights
    _kill(second)  # before anything trained under version 2
    third = training_that_saves(tmp_path, save_every=4)
    assert third.optimizer.version == 3
    third.train_until_idle()
    assert third.optimizer.version == 4
    third.ledger.flush()
    assert {r.request.id: (r.fate, r.fate_version) for r in read_ledger(tmp_path / LEDGER_FILE)
            if r.label is not None} == {"r0": ("trained", 4)}
    third.close()


def test_a_version_is_not_saved_while_the_fates_it_trained_wait_for_their_retry(tmp_path):
    """A save first puts the fates its version trained on disk; when the ledger cannot be
    written (another writer holds it), the save fails and is counted, and a crash then
    resumes from a version that does not hold those labels, which train again."""
    training = training_that_saves(tmp_path, save_every=1000)
    serve(training, "r0")
    label(training, "r0")
    training.train_until_idle()
    checkpointer = training.lifecycle.checkpointer
    assert training.optimizer.version == 1 and checkpointer.last_saved_version == 0
    blocker = sqlite3.connect(tmp_path / LEDGER_FILE, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        training.ledger.record_fate("r0", "trained", version=1, path="recompute")  # it waits behind the lock
        with pytest.raises(LedgerUnavailable):
            training.ledger.flush(strict=True)
        assert checkpointer.save_async(training.lifecycle.snapshot()).result() is None
        assert checkpointer.failed == 1 and not checkpointer.store.is_saved(1)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert checkpointer.save_async(training.lifecycle.snapshot()).result() is not None  # the lock gone, it saves
    assert rows_by_id(tmp_path / LEDGER_FILE)["r0"].fate_version == 1
    training.close()


def filled_with_labels(ledger: Ledger) -> list[str]:
    """Fills `ledger` (a small `max_bytes`) with labels still to be trained, which retention
    cannot drop; their requests' ids."""
    labelled = []
    for i in range(2000):
        ledger.record_request(request_record(i, time.time()))
        try:
            ledger.commit_label(f"req-{i}", LABEL)
        except LedgerUnavailable:
            return labelled
        labelled.append(f"req-{i}")
    pytest.fail("the ledger never filled")


def make_room(ledger: Ledger, labelled: list[str]) -> None:
    """The labels trained into version 1, which is saved: retention may drop them now."""
    for request_id in labelled:
        ledger.record_fate(request_id, "trained", version=1, path="recompute")
    ledger.flush(strict=True)  # the fates landed: version 1 may be saved
    ledger.saved(1)
    ledger.prune()
    ledger.flush()


def test_a_full_ledger_still_lets_versions_be_saved_and_their_labels_then_make_room(tmp_path):
    """A full ledger tries each write alone: a new request's row waits for its retry, but no
    save depends on it (a strict flush waits for owed writes only), so the version holding
    the trained labels is saved, and retention then makes room from them (a review found
    saves stopped for good: every save failed, so no label could ever be pruned)."""
    ledger = Ledger(tmp_path / LEDGER_FILE, LedgerConfig(max_bytes=1 << 20))
    # as a server's: a process that saves versions, so no label trained into version 1 is pruned before
    # it is saved (without, the fates' own commit could make room, and the retry land before it is seen)
    ledger.resumed(0, 0)
    try:
        labelled = filled_with_labels(ledger)
        ledger.record_request(request_record(9999, time.time()))  # waits for its retry
        ledger.flush()
        assert ledger.stats.retry_backlog > 0
        make_room(ledger, labelled)
        assert ledger.stats.retry_backlog == 0 and ledger.stats.pruned_requests > 0
        assert "req-9999" in rows_by_id(tmp_path / LEDGER_FILE)
    finally:
        ledger.close()


def test_a_requests_writes_land_in_their_order_when_its_row_waits_for_room(tmp_path):
    """A request served while the ledger is full: its row waits for its retry, and its
    answer, written after it, waits behind it, as a label or a deletion of it is refused
    (503) meanwhile. An outside pass on a real full disk found the answer's update run
    before the row it updates, matching no row: the ledger lost the request's choices, and
    after a kill its label did not train (or it took none), nor could it be exported."""
    ledger = Ledger(tmp_path / LEDGER_FILE, LedgerConfig(max_bytes=1 << 20))
    ledger.resumed(0, 0)
    try:
        labelled = filled_with_labels(ledger)
        refused = ledger.stats.refused_writes
        ledger.record_request(request_record(9999, time.time(), tokens=8000))  # more than retention frees now
        ledger.record_finished("req-9999", [ChoiceRecord(0, [5, 6], "Paris.", finish_reason="stop")], False)
        with pytest.raises(LedgerUnavailable, match="cannot be written"):
            ledger.commit_label("req-9999", LABEL)
        with pytest.raises(LedgerUnavailable, match="cannot be written"):
            ledger.delete("req-9999")  # not "nothing to delete", with its row to land after
        assert ledger.stats.refused_writes == refused + 2
        make_room(ledger, labelled)
        row = rows_by_id(tmp_path / LEDGER_FILE)["req-9999"]
        assert row.choices == [ChoiceRecord(0, [5, 6], "Paris.", finish_reason="stop")]
        ledger.commit_label("req-9999", LABEL)
    finally:
        ledger.close()


def test_retention_keeps_a_label_trained_into_a_version_not_saved_yet(tmp_path):
    now = [time.time()]
    ledger = Ledger(tmp_path / LEDGER_FILE, LedgerConfig(retention_days=1), clock=lambda: now[0])
    try:
        ledger.saved(6)  # the process that saves versions says which is on disk
        for i in range(2):
            ledger.record_request(request_record(i, now[0], tokens=4))
            ledger.commit_label(f"req-{i}", LABEL)
            ledger.record_fate(f"req-{i}", "trained", version=7 + i, path="recompute")
        now[0] += 2 * 86400  # both past the retention of one day
        ledger.prune()  # neither version is saved: a crash would hand both back to the restart
        assert sorted(rows_by_id(tmp_path / LEDGER_FILE)) == ["req-0", "req-1"]
        ledger.saved(7)
        ledger.prune()
        assert sorted(rows_by_id(tmp_path / LEDGER_FILE)) == ["req-1"]  # version 8 is not saved yet
    finally:
        ledger.close()


def test_a_request_deleted_whole_is_remembered_as_deleted_for_the_retention_only(tmp_path):
    """DELETE /v1/chat/completions/{id} keeps the id alone, so that its label sent again is
    told it was deleted after a restart (a README pass read "unknown"); retention prunes it."""
    now = [time.time()]
    ledger = Ledger(tmp_path / LEDGER_FILE, LedgerConfig(retention_days=1), clock=lambda: now[0])
    try:
        ledger.record_request(request_record(0, now[0], tokens=4))
        ledger.commit_label("req-0", LABEL)
        assert ledger.delete("req-0").found and "req-0" not in rows_by_id(tmp_path / LEDGER_FILE)
        assert deleted_requests(tmp_path / LEDGER_FILE, "req-0") == ["req-0"]
        assert remembered(tmp_path / LEDGER_FILE, "req-0").deleted
        now[0] += 2 * 86400
        ledger.prune()
        ledger.flush()
        assert deleted_requests(tmp_path / LEDGER_FILE, "req-0") == []
        assert remembered(tmp_path / LEDGER_FILE, "req-0") is None
    finally:
        ledger.close()


def test_a_ledger_no_saving_process_writes_prunes_trained_labels_as_before(tmp_path):
    """Another node's ledger, with data-parallel replicas: its process saves no version and
    so never learns which are saved; its trained labels go by retention, as they always did
    (not kept for ever, filling the file)."""
    now = [time.time()]
    ledger = Ledger(tmp_path / LEDGER_FILE, LedgerConfig(retention_days=1), clock=lambda: now[0])
    try:
        for i, fate in enumerate(("trained", None)):
            ledger.record_request(request_record(i, now[0], tokens=4))
            ledger.commit_label(f"req-{i}", LABEL)
            if fate:
                ledger.record_fate(f"req-{i}", fate, version=3, path="recompute")
        now[0] += 2 * 86400
        ledger.prune()
        assert sorted(rows_by_id(tmp_path / LEDGER_FILE)) == ["req-1"]  # the one not trained stays
    finally:
        ledger.close()


def test_a_restart_records_the_version_it_resumed_at_as_saved(tmp_path):
    first = training_that_saves(tmp_path, save_every=1)
    serve(first, "r0")
    label(first, "r0")
    first.train_until_idle()
    _kill(first)
    second = training_that_saves(tmp_path)
    assert second.lifecycle.restored_from == 1
    second.ledger.flush()
    with sqlite3.connect(tmp_path / LEDGER_FILE) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'saved_version'").fetchone() == ("1",)
    second.close()


def test_deleting_a_label_released_while_the_server_runs_is_not_taken_for_one_in_training(tmp_path):
    """A rollback quarantined it, `alchemist feedback release` released it (no fate, in no
    weights) while the cache still remembers it trained: its deletion is no 409
    `label_in_training`, which says the label is in the next version's weights."""
    training = training_that_saves(tmp_path)
    serve(training, "r0")
    label(training, "r0")
    training.train_until_idle()
    training.ledger.flush()
    with sqlite3.connect(tmp_path / LEDGER_FILE) as conn:  # what a rollback to version 0 leaves
        conn.execute("UPDATE requests SET fate = 'quarantined', fate_reason = 'rolled back to version 0' "
                     "WHERE id = 'r0'")
    assert len(release_quarantined(tmp_path / LEDGER_FILE)) == 1
    forgotten = training.forget("r0", label_only=True)
    assert forgotten.found and forgotten.training == []
    training.close()


def test_a_replica_that_saves_no_version_records_a_rollback_in_its_nodes_ledger(tmp_path):
    """With data-parallel replicas only rank 0 saves versions; another node's ledger is
    its own, and the labels a rollback undid leave the weights there too."""
    ledger = Ledger(tmp_path / LEDGER_FILE)
    training = make_training(DPO, ledger=ledger)  # no checkpointer: a replica other than rank 0
    before = training.lifecycle.snapshot()
    serve(training, "r0")
    label(training, "r0")
    training.train_until_idle()
    assert training.optimizer.version == 1
    training.rollback(before)
    ledger.flush()
    assert rows_by_id(tmp_path / LEDGER_FILE)["r0"].fate == "quarantined"
    training.close()


def test_a_number_another_nodes_ledger_knows_is_not_given_again_and_that_node_learns_the_lineage(tmp_path):
    """With replicas on several nodes, each node's ledger holds what that node served and
    trained (a review: traffic on node 1 alone, then a kill; rank 0's ledger knew only the
    saved version). Rank 0 resumes after the largest number any node's ledger knows
    (server/build.py agrees on it, `ReplicaSync.largest`), and a replica that saves no
    version records in its node's ledger which versions died unsaved."""
    (tmp_path / "node0").mkdir()
    rank0 = training_that_saves(tmp_path / "node0", save_every=1)
    assert rank0.lifecycle.known_version() == -1  # nothing served or trained yet (version 0: the store's)
    rank0.lifecycle.resume(known=17)  # node 1 served and trained up to version 17
    assert (rank0.optimizer.version, rank0.lifecycle.restored_from) == (18, 0)
    adopted = rank0.lifecycle.snapshot()
    rank0.close()
    node1 = Ledger(tmp_path / LEDGER_FILE)
    replica = make_training(DPO, ledger=node1)  # no checkpointer: a replica other than rank 0
    replica.lifecycle.restore(adopted, adopted.version)  # what adopt_rank0 does
    replica.lifecycle.adopted(adopted)
    assert (replica.optimizer.version, replica.lifecycle.restored_from) == (18, 0)
    node1.flush()
    with sqlite3.connect(tmp_path / LEDGER_FILE) as conn:
        assert lineage(conn, 19) == [(18, 19), (0, 0)]  # versions 1 to 17 are not in these weights
        assert conn.execute("SELECT value FROM meta WHERE key = 'saved_version'").fetchone() is None
    replica.close()


def test_the_fate_of_a_request_whose_row_waits_for_room_does_not_hold_up_the_save_that_makes_room(tmp_path):
    """A request served while the ledger is full, whose entry then ended unlabelled: its fate
    waits behind its row, and no save waits for it (a review found every save refused for
    good: room comes only from labels a saved version holds)."""
    ledger = Ledger(tmp_path / LEDGER_FILE, LedgerConfig(max_bytes=1 << 20))
    ledger.resumed(0, 0)
    try:
        labelled = filled_with_labels(ledger)
        ledger.record_request(request_record(9999, time.time(), tokens=8000))  # waits for room
        ledger.record_fate("req-9999", "expired")
        make_room(ledger, labelled)  # a strict flush first: the save may go ahead
        assert rows_by_id(tmp_path / LEDGER_FILE)["req-9999"].fate == "expired"
    finally:
        ledger.close()


def test_what_waits_behind_a_write_kept_for_its_retry():
    """RetryBacklog's order: behind a request's row, all its writes; behind its fate, its next
    fate alone (its answer writes other columns); behind a fate a save waits for, a lineage
    (a rollback, a quarantine); behind a prompt's row, the deletion of its batch. A fate
    behind its request's row holds no save up (the regression test above)."""
    def write(**kwargs) -> QueuedWrite:
        return QueuedWrite(lambda conn: None, **kwargs)

    backlog = RetryBacklog()
    row = write(request_id="batch-0", inserts_row=True)
    backlog.keep(row, OSError("database or disk is full"))
    assert backlog.holds_back(write(request_id="batch-0"))  # its answer
    assert backlog.holds_back(write(request_id="batch", with_prompts=True))  # the batch's deletion
    assert not backlog.holds_back(write(request_id="batch"))  # another request's label
    fate_behind_row = write(request_id="batch-0", owed=True)
    assert backlog.holds_back(fate_behind_row)
    backlog.keep(fate_behind_row)
    assert backlog.owed_waiting() == 0 and not backlog.holds_back(write(owed=True))
    fate = write(request_id="s", owed=True)
    backlog.keep(fate, OSError("database or disk is full"))
    assert backlog.owed_waiting() == 1
    assert backlog.holds_back(write(request_id="s", owed=True)) and not backlog.holds_back(write(request_id="s"))
    assert backlog.holds_back(write(owed=True)) and not backlog.holds_back(write())  # a rollback; a flush
    assert backlog.take() == [row, fate_behind_row, fate] and backlog.owed_waiting() == 0
    assert not backlog.holds_back(write(request_id="batch-0")) and not backlog.holds_back(write(owed=True))


def test_versions_given_while_nothing_could_be_written_are_not_given_again(tmp_path, monkeypatch):
    """A version trained and served while neither the ledger nor a save could be written
    (a full disk), then a stop: the restart resumes version 0's weights under a number after
    it (an outside pass saw it call them 0, and name the next step as the lost one: one
    number, two adapters). The directory's VersionMark kept it."""
    monkeypatch.setattr("trainer.ledger_file.BUSY_TIMEOUT_S", 0.05)
    training = training_that_saves(tmp_path, save_every=100)
    for request_id in ("r0", "r1"):
        serve(training, request_id)
        label(training, request_id)
    blocker = sqlite3.connect(tmp_path / LEDGER_FILE, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # what the full disk refuses: every write of the ledger, and so every save
    try:
        training.train_until_idle()
        lost = training.optimizer.version
        assert lost >= 1
        training.close()  # its final save refused: the fates it trained are not on disk
        assert not training.lifecycle.checkpointer.store.is_saved(lost)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    again = training_that_saves(tmp_path, save_every=100)
    assert again.lifecycle.restored_from == 0 and again.optimizer.version > lost
    again.close()
