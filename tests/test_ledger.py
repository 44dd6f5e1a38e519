"""The feedback ledger: a label is on disk before feedback answers 200; a ledger that cannot
be written answers 503 and loses nothing it held; retention by age and size never drops
a label still to be trained; the file is its owner's; what the server keeps of a
completion can be deleted; a restart trains every label not in the resumed version and
still takes feedback for recent requests."""

import dataclasses
import json
import sqlite3
import stat
import threading
import time

import pytest
from fastapi.testclient import TestClient

import engine.async_engine as async_engine
from engine.sampling_params import SamplingParams
from tests.conftest import encode, engine_of, make_training, run_into_a_backward
from tests.servers import TINY_NAME, tiny_app, wait_for
from tests.test_no_label_lost import metric
from tests.test_training import label, serve
from trainer.adapter_store import AdapterCheckpointer, AdapterStore
from trainer.config import AdapterConfig, LedgerConfig, TrainConfig
from trainer.entries import EntryState
from trainer.feedback import FeedbackLabel, FeedbackOutcome
from trainer.ledger import Ledger, LabelExists, LedgerUnavailable
from trainer.ledger_db import LEDGER_FILE, ChoiceRecord, LabelRecord, RequestRecord, read_ledger, release_quarantined

DPO = TrainConfig(mode="dpo", lora_rank=4)
CHAT = {"model": TINY_NAME, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def chat(client) -> str:
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def rows_by_id(path) -> dict:
    return {row.request.id: row for row in read_ledger(path)}


def test_an_answer_goes_out_once_the_ledger_holds_it_so_a_kill_right_after_cannot_lose_its_label(tmp_path,
                                                                                                   monkeypatch):
    """A label is looked up in the ledger after a restart: an answer sent before its row was
    committed, and a kill -9 within those milliseconds, made its label a 404 (an outside
    kill sweep: 2 of 6 kills right after an answer). The writer is slowed here, so that the
    answer would come first if it did not wait (and the wait's bound lifted: a loaded
    machine's slow commits must not let it go)."""
    transaction = Ledger._transaction

    def slow_transaction(self, batch):
        time.sleep(0.1)
        transaction(self, batch)

    monkeypatch.setattr(Ledger, "_transaction", slow_transaction)
    monkeypatch.setattr(async_engine, "ANSWER_WRITE_WAIT_S", 120.0)
    app = tiny_app(train=DPO, adapter=AdapterConfig(dir=str(tmp_path)))
    with TestClient(app) as client:
        for stream in (False, True):
            r = client.post("/v1/chat/completions", json={**CHAT, "n": 2, "temperature": 1.0, "stream": stream})
            assert r.status_code == 200, r.text
            completion = r.json()["id"] if not stream else next(
                json.loads(line[6:])["id"] for line in r.text.splitlines() if line.startswith("data: {"))
            row = rows_by_id(tmp_path / LEDGER_FILE)[completion]  # another connection, at once
            assert row.finished_at is not None and [c.index for c in row.choices] == [0, 1], stream
        untrained = client.post("/v1/chat/completions", json={**CHAT, "train": False})
        assert untrained.status_code == 200  # a request the ledger does not keep waits for nothing


def test_a_label_is_on_disk_before_feedback_answers_200(tmp_path):
    app = tiny_app(train=DPO, adapter=AdapterConfig(dir=str(tmp_path)))
    with TestClient(app) as client:
        completion = chat(client)
        r = client.post("/v1/feedback", json={"id": completion, "chosen": "Paris."})
        assert r.status_code == 200, r.text
        row = rows_by_id(tmp_path / LEDGER_FILE)[completion]  # another connection, at once
        assert row.label.kind == "preference" and row.label.chosen == "Paris." and row.label.rejected is None
        assert row.label.source == "api" and row.label.choice_index == 0
        assert row.label.rejected_token_ids == row.choices[0].token_ids  # the served response is the rejected side
        assert row.request.prompt == CHAT["messages"] and row.request.method == "dpo"
        assert row.request.adapter_version == 0 and len(row.request.prompt_token_ids) > 5
        assert len(row.choices[0].token_logprobs) == len(row.choices[0].token_ids) and row.choices[0].text
        assert row.finished_at >= row.request.served_at > time.time() - 600
    for name in (LEDGER_FILE, LEDGER_FILE + "-wal"):
        path = tmp_path / name
        if path.exists():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, name


def test_feedback_answers_503_while_the_ledger_cannot_be_written_and_loses_nothing(tmp_path, caplog):
    """And says so: in `feedback_total{status="unavailable"}` and in the log (an outside
    pass saw neither)."""
    app = tiny_app(train=DPO, adapter=AdapterConfig(dir=str(tmp_path)))
    with TestClient(app) as client:
        first, second = chat(client), chat(client)
        assert client.post("/v1/feedback", json={"id": first, "chosen": "Paris."}).status_code == 200
        app.state.alchemist.training.ledger.flush()
        blocker = sqlite3.connect(tmp_path / LEDGER_FILE, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")  # another writer holds the database
        try:
            r = client.post("/v1/feedback", json={"id": second, "chosen": "Paris!"})
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "ledger_unavailable"
            assert client.delete(f"/v1/feedback/{first}").status_code == 503  # nor is anything deleted
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        rows = rows_by_id(tmp_path / LEDGER_FILE)
        assert rows[first].label.chosen == "Paris." and rows[second].label is None
        # the refused label was not attached: sent again, it is accepted
        assert client.post("/v1/feedback", json={"id": second, "chosen": "Paris!"}).status_code == 200
        assert rows_by_id(tmp_path / LEDGER_FILE)[second].label.chosen == "Paris!"
        assert metric(client, "alchemist:ledger_refused_writes_total") == 2  # the label and the deletion
        assert metric(client, 'alchemist:feedback_total{status="unavailable"}') == 1
        assert [r.message for r in caplog.records if "labels and deletions get 503" in r.message]
        assert metric(client, "alchemist:ledger_rows_written_total") >= 6  # 2 requests, 2 finishes, 2 labels


def test_an_answers_write_that_fails_lets_its_answer_go_and_lands_on_a_retry(tmp_path):
    """The answer waits for its request's commit; one the ledger cannot make (another
    writer holds the database) lets it go at once, rather than after the answer's bound,
    and, while writes fail, no answer waits at all."""
    path = tmp_path / LEDGER_FILE
    ledger = Ledger(path)
    try:
        ledger.record_request(request_record(0, time.time()))
        ledger.flush()
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            written = ledger.record_finished("req-0", [ChoiceRecord(0, [1], "a")], False)
            written.result(timeout=30)  # tried and failed: done, not pending
            assert ledger.record_finished("req-0", [ChoiceRecord(0, [1], "a")], False) is None
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        ledger.flush(strict=True)
        assert rows_by_id(path)["req-0"].choices == [ChoiceRecord(0, [1], "a")]
    finally:
        ledger.close()


def test_while_the_ledger_cannot_be_written_its_log_says_so_once_a_minute(tmp_path, caplog, monkeypatch):
    """Not once per queued write and per retry (an outside pass saw 206 lines from about 20
    requests on a read-only disk), with the writes waiting, counted, and landing after."""
    monkeypatch.setattr("trainer.ledger_file.BUSY_TIMEOUT_S", 0.05)  # (each try waits for the lock that long)
    path = tmp_path / LEDGER_FILE
    ledger = Ledger(path)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        for i in range(20):
            ledger.record_request(request_record(i, time.time(), tokens=4))
            ledger.flush()  # a retry of every write waiting, each time
        assert ledger.stats.retry_backlog == 20
        for _ in range(2):
            with pytest.raises(LedgerUnavailable):
                ledger.commit_label("req-0", LabelRecord("preference", chosen="yes"), timeout_s=5)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    ledger.flush(strict=True)
    ledger.close()
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("trainer.ledger")]
    said = ("writes fail (database is locked)", "labels and deletions get 503", "retention failed: database is locked")
    assert sorted(next(i for i, words in enumerate(said) if words in w) for w in warnings) == [0, 1, 2], warnings
    assert ledger.stats.refused_writes == 2
    assert len(rows_by_id(path)) == 20


def test_writes_a_stop_leaves_unmade_are_said_lost(tmp_path, caplog, monkeypatch):
    """A stop while the ledger cannot be written (an outside pass: 16 queued writes went
    without a word, and the requests they recorded took no label after the restart)."""
    monkeypatch.setattr("trainer.ledger_file.BUSY_TIMEOUT_S", 0.05)
    ledger = Ledger(tmp_path / LEDGER_FILE)
    blocker = sqlite3.connect(tmp_path / LEDGER_FILE, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        for i in range(3):
            ledger.record_request(request_record(i, time.time(), tokens=4))
        ledger.flush()
        ledger.close()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert any("3 writes could not be made before the stop" in r.getMessage() for r in caplog.records)


def request_record(i: int, served_at: float, tokens: int = 400) -> RequestRecord:
    return RequestRecord(f"req-{i}", served_at, 0, "dpo", list(range(tokens)), [{"role": "user", "content": "hi"}])


def test_a_full_ledger_refuses_labels_keeps_what_it_holds_and_makes_room_from_what_retention_may_drop(tmp_path):
    ledger = Ledger(tmp_path / LEDGER_FILE, LedgerConfig(max_bytes=1 << 20))
    try:
        committed, refused = [], None
        for i in range(2000):
            ledger.record_request(request_record(i, time.time()))
            try:
                ledger.commit_label(f"req-{i}", LabelRecord("preference", chosen="yes", chosen_token_ids=[1],
                                                            rejected_token_ids=[2]))
            except LedgerUnavailable as exc:
                refused = exc
                break
            committed.append(f"req-{i}")
        assert refused is not None and "full" in str(refused), "the ledger never filled"
        labelled = {row.request.id for row in read_ledger(tmp_path / LEDGER_FILE) if row.label is not None}
        assert labelled == set(committed)  # nothing committed before was touched
        assert (tmp_path / LEDGER_FILE).stat().st_size <= (1 << 20) + 65536
        for request_id in committed[: len(committed) // 2]:  # trained into a saved version: retention may drop them
            ledger.record_fate(request_id, "trained", version=1, path="reuse")
        ledger.saved(1)
        ledger.record_request(request_record(9999, time.time()))
        ledger.commit_label("req-9999", LabelRecord("preference", chosen="yes", chosen_token_ids=[1],
                                                    rejected_token_ids=[2]))
        kept = {row.request.id for row in read_ledger(tmp_path / LEDGER_FILE)}
        assert set(committed[len(committed) // 2:]) | {"req-9999"} <= kept  # labels still to be trained stay
        assert ledger.stats.pruned_requests > 0
    finally:
        ledger.close()


def test_retention_drops_old_requests_oldest_first_but_never_a_label_still_to_be_trained(tmp_path):
    now = [time.time()]
    ledger = Ledger(tmp_path / LEDGER_FILE, LedgerConfig(retention_days=1), clock=lambda: now[0])
    try:
        start = now[0]
        for i in range(3):
            ledger.record_request(request_record(i, start, tokens=4))
        ledger.record_request(request_record(3, start + 1.5 * 86400, tokens=4))
        ledger.commit_label("req-1", LabelRecord("rewards", rewards=[1.0, 0.0]))  # to be trained
        ledger.commit_label("req-2", LabelRecord("rewards", rewards=[1.0, 0.0]))
        ledger.record_fate("req-2", "trained", version=3, path="recompute")
        ledger.saved(3)
        now[0] = start + 2 * 86400  # two days on: requests 0-2 are past the retention of one
        ledger.prune()
        assert sorted(rows_by_id(tmp_path / LEDGER_FILE)) == ["req-1", "req-3"]
        with pytest.raises(LabelExists):
            ledger.commit_label("req-1", LabelRecord("rewards", rewards=[0.0, 1.0]))
    finally:
        ledger.close()


def test_deleting_a_label_or_a_stored_completion_over_http(tmp_path):
    app = tiny_app(train=DPO, adapter=AdapterConfig(dir=str(tmp_path)))
    with TestClient(app) as client:
        labelled, stored = chat(client), chat(client)
        training = app.state.alchemist.training
        assert client.delete(f"/v1/feedback/{stored}").status_code == 404  # it has no label
        r = client.delete(f"/v1/chat/completions/{stored}")
        assert r.status_code == 200 and r.json() == {"id": stored, "object": "chat.completion.deleted",
                                                     "deleted": True, "trained_into_version": None}
        assert training.cache.get(stored) is None  # it can no longer be trained on
        assert client.post("/v1/feedback", json={"id": labelled, "chosen": "Paris."}).status_code == 200
        r = client.delete(f"/v1/feedback/{labelled}")
        answer = r.json()
        assert r.status_code == 200 and answer.pop("trained_into_version") in (None, 1)  # (if its job ran first)
        assert answer == {"id": labelled, "object": "feedback.deleted", "deleted": True}
        training.ledger.flush()
        rows = rows_by_id(tmp_path / LEDGER_FILE)
        assert stored not in rows and rows[labelled].label is None
        for path in (f"/v1/feedback/{labelled}", f"/v1/chat/completions/{stored}", "/v1/feedback/nope"):
            r = client.delete(path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
        r = client.post("/v1/feedback", json={"id": stored, "chosen": "Lyon."})  # deleted: 404, saying so
        assert r.status_code == 404 and "deleted" in r.json()["error"]["message"], r.text


def test_a_completion_of_several_prompts_is_deleted_by_its_id_with_every_prompt(tmp_path):
    """`/v1/completions` with a list of prompts keeps a request per prompt (`<id>-<i>`);
    deleting the id the client was given deletes them all, and nothing else."""
    app = tiny_app(train=DPO, adapter=AdapterConfig(dir=str(tmp_path)))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": ["One", "Two"], "max_tokens": 3})
        batch, other = r.json()["id"], chat(client)
        assert client.post("/v1/feedback", json={"id": batch, "chosen": "Better.", "choice_index": 1}).status_code \
            == 200
        r = client.delete(f"/v1/feedback/{batch}")
        assert r.status_code == 200 and r.json()["deleted"], r.text
        training = app.state.alchemist.training
        training.ledger.flush()
        rows = rows_by_id(tmp_path / LEDGER_FILE)
        assert rows[f"{batch}-1"].label is None and {f"{batch}-0", f"{batch}-1", other} <= set(rows)
        r = client.delete(f"/v1/chat/completions/{batch}")
        assert r.status_code == 200 and r.json()["deleted"], r.text
        assert training.cache.get(f"{batch}-0") is None
        wait_for(lambda: training.cache.get(f"{batch}-1") is None)  # withdrawn, or its training had begun
        training.ledger.flush()
        assert set(rows_by_id(tmp_path / LEDGER_FILE)) == {other}
        r = client.post("/v1/feedback", json={"id": batch, "chosen": "x", "choice_index": 0})
        assert r.status_code == 404 and "deleted" in r.json()["error"]["message"], r.text
        assert client.delete(f"/v1/chat/completions/{batch}").status_code == 404


def test_deleting_an_id_deletes_its_prompts_and_no_other_id(tmp_path):
    ledger = Ledger(tmp_path / LEDGER_FILE, LedgerConfig())
    ids = ["cmpl-a-0", "cmpl-a-12", "cmpl-a-1x", "cmpl-a-", "cmpl-a-0-1", "cmpl-ab-0", "cmpl-a.0", "cmpl-a", "*-0",
           "%-0"]
    try:
        for request_id in ids:
            ledger.record_request(RequestRecord(request_id, time.time(), 0, "dpo", [1, 2], "hi"))
        for pattern in ("*", "%", "cmpl-[a]", "cmpl-?"):  # an id's characters are never a pattern
            assert not ledger.delete(pattern).found or pattern in ("*", "%")
        assert ledger.delete("cmpl-a").found
        assert set(rows_by_id(tmp_path / LEDGER_FILE)) == {"cmpl-a-1x", "cmpl-a-", "cmpl-a-0-1", "cmpl-ab-0",
                                                           "cmpl-a.0"}
    finally:
        ledger.close()


def test_a_deleted_label_is_not_trained_on(tmp_path):
    training = _training(tmp_path)
    serve(training, "r0")
    label(training, "r0")
    assert training.forget("r0", label_only=True).found
    assert training.cache.get("r0") is None
    again = training.feedback.submit(FeedbackLabel("r0", "A new label.", None, 0))
    assert again.outcome is FeedbackOutcome.UNKNOWN and "deleted" in again.message
    training.train_until_idle()
    assert training.stats.copy().trained_entries == {}
    training.ledger.flush()
    row = rows_by_id(tmp_path / LEDGER_FILE)["r0"]
    assert row.label is None and (row.fate, row.fate_reason) == ("dropped", "deleted")
    training.close()


def _training(root, save_every: int = 10, config: TrainConfig = DPO):
    """Training (DPO) on `root` as a server builds it: versions saved there, and the ledger."""
    ledger = Ledger(root / LEDGER_FILE)
    return make_training(config, checkpointer=AdapterCheckpointer(AdapterStore(root), save_every, ledger),
                         ledger=ledger)


def crash(training) -> None:
    """What a kill leaves: queued ledger writes may be lost, but here they have landed
    (labels are committed before they are accepted), and so have the saves already begun
    (each flushes the ledger first: closed before them, it failed them, one run in a few);
    nothing is saved at exit."""
    if training.lifecycle.checkpointer is not None:  # (a replica that saves no version has none)
        training.lifecycle.checkpointer.wait()
    training.ledger.flush()
    training.ledger.close()


@pytest.mark.parametrize("trained_before", [False, True], ids=["pending", "trained-not-saved"])
def test_after_a_restart_every_label_not_in_the_resumed_version_trains_and_recent_requests_take_labels(
        tmp_path, trained_before):
    first = _training(tmp_path)
    for i in range(4):
        serve(first, f"r{i}")
    for i in range(2):
        label(first, f"r{i}")
    if trained_before:
        first.train_until_idle()
        assert first.optimizer.version >= 1 and first.lifecycle.checkpointer.last_saved_version == 0
    lost = first.optimizer.version
    crash(first)

    second = _training(tmp_path)  # version 0's weights, under a number no lost version had
    assert second.optimizer.version == (lost + 1 if trained_before else 0) and second.lifecycle.restored_from == 0
    states = {f"r{i}": second.cache.get(f"r{i}").state.value for i in range(4)}
    assert states == {"r0": "ready", "r1": "ready", "r2": "waiting_label", "r3": "waiting_label"}
    label(second, "r2")  # served before the crash, labelled after it
    second.train_until_idle()
    assert second.stats.copy().trained_entries == {("dpo", "recompute"): 3}
    second.ledger.flush()
    rows = rows_by_id(tmp_path / LEDGER_FILE)
    assert {i: (rows[i].fate, rows[i].fate_path) for i in ("r0", "r1", "r2")} == {
        i: ("trained", "recompute") for i in ("r0", "r1", "r2")}
    assert rows["r3"].fate is None and rows["r3"].label is None
    second.close()


def test_a_label_the_crash_took_back_stays_to_train_through_a_version_saved_before_it_and_a_second_crash(tmp_path):
    """A restart resumes the saved version's weights (under a number after the lost ones):
    a label trained into a lost version is untrained in the ledger at once, so that a
    version saved before it trains again does not pass for one that holds it."""
    first = _training(tmp_path)
    for i in range(2):
        serve(first, f"r{i}")
        label(first, f"r{i}")
    first.train_until_idle()
    crash(first)
    second = _training(tmp_path)
    rows = rows_by_id(tmp_path / LEDGER_FILE)
    assert [(rows[i].fate, rows[i].fate_version) for i in ("r0", "r1")] == [(None, None)] * 2
    assert second.optimizer.version == 2  # version 0's weights; version 1 died unsaved
    second.optimizer.step(entries=0)  # a version of the second process, saved before r0 and r1 train again
    assert second.lifecycle.checkpointer.save_async(second.lifecycle.snapshot()).result() is not None
    crash(second)
    third = _training(tmp_path)
    assert third.lifecycle.restored_from == 3
    assert {third.cache.get(f"r{i}").state.value for i in range(2)} == {"ready"}
    third.train_until_idle()
    assert third.stats.copy().trained_entries == {("dpo", "recompute"): 2}
    third.close()


def test_a_label_deleted_while_it_trained_into_a_lost_version_takes_no_new_label_after_the_restart(tmp_path):
    first = _training(tmp_path)
    serve(first, "r0")
    label(first, "r0")
    first.train_until_idle()
    first.ledger.delete("r0", label_only=True)  # what DELETE /v1/feedback/{id} leaves of an entry being trained
    crash(first)
    second = _training(tmp_path)
    assert second.cache.get("r0") is None
    again = second.feedback.submit(FeedbackLabel("r0", "A new label.", None, 0))
    assert again.outcome is FeedbackOutcome.UNKNOWN and "deleted" in again.message, again.message
    second.train_until_idle()
    assert second.stats.copy().trained_entries == {}
    second.ledger.flush()
    row = rows_by_id(tmp_path / LEDGER_FILE)["r0"]
    assert (row.fate, row.fate_reason) == ("dropped", "deleted")
    second.close()


def test_feedback_for_a_request_a_crash_cut_short_says_so_after_the_restart(tmp_path):
    first = _training(tmp_path)
    for request_id in ("cut", "aborted"):
        first.ledger.record_request(RequestRecord(request_id, time.time(), 0, "dpo", [1, 2, 3], "Hi"))
    first.ledger.record_finished("aborted", [], True)  # "cut" never finished
    crash(first)
    second = _training(tmp_path)
    for request_id in ("cut", "aborted"):
        result = second.feedback.submit(FeedbackLabel(request_id, "A label.", None, 0))
        assert result.outcome is FeedbackOutcome.UNKNOWN and "dropped" in result.message, result.message
    second.ledger.flush()
    rows = rows_by_id(tmp_path / LEDGER_FILE)
    assert (rows["cut"].fate_reason, rows["aborted"].fate_reason) == ("interrupted", "aborted")
    second.close()
    third = _training(tmp_path)  # their fates landed: this start's cache never knew them (an outside pass: "unknown")
    for request_id, why in (("cut", "its request was in flight"), ("aborted", "its request was cut short")):
        result = third.feedback.submit(FeedbackLabel(request_id, "A label.", None, 0))
        assert result.outcome is FeedbackOutcome.UNKNOWN and f"is dropped ({why}" in result.message, result.message
    third.close()


def test_a_restart_takes_back_the_cpt_prompts_served_and_not_those_their_clients_left(tmp_path):
    """As online (a client retrying after its timeout sends a CPT prompt again): a prompt
    whose client left is dropped, saying why. One whose end the ledger missed may have
    been answered (an answer waits for that commit 1 s at most): it trains."""
    first = _training(tmp_path, config=TrainConfig(mode="cpt", lora_rank=4))
    for request_id in ("whole", "cut", "aborted"):
        first.ledger.record_request(RequestRecord(request_id, time.time(), 0, "cpt", [1, 2, 3, 4], "Hi"))
    first.ledger.record_finished("whole", [ChoiceRecord(0, [5], "Yes", None, "stop")], False)
    first.ledger.record_finished("aborted", [ChoiceRecord(0, [5], "Ye", None, "abort")], True)
    crash(first)
    second = _training(tmp_path, config=TrainConfig(mode="cpt", lora_rank=4))
    second.train_until_idle()
    assert second.stats.copy().trained_entries == {("cpt", "recompute"): 2}
    second.ledger.flush()
    rows = rows_by_id(tmp_path / LEDGER_FILE)
    assert [(rows[i].fate, rows[i].fate_reason) for i in ("whole", "cut", "aborted")] == [
        ("trained", None), ("trained", None), ("dropped", "aborted")]
    second.close()


def test_deleting_a_batch_after_a_restart_withdraws_the_prompts_the_restart_took_back(tmp_path):
    """The first prompt was trained and saved before the crash (the restart does not take
    it back), the second waits to be trained: deleting the batch's id withdraws it."""
    first = _training(tmp_path, save_every=1)
    serve(first, "cmpl-x-0")
    label(first, "cmpl-x-0")
    first.train_until_idle()
    serve(first, "cmpl-x-1")
    label(first, "cmpl-x-1")
    crash(first)
    second = _training(tmp_path, save_every=1)
    assert second.cache.get("cmpl-x-0") is None and second.cache.get("cmpl-x-1").state.value == "ready"
    assert second.forget("cmpl-x").found
    assert second.cache.get("cmpl-x-1") is None
    second.train_until_idle()
    assert second.stats.copy().trained_entries == {}
    second.close()


def test_a_restart_knows_the_version_it_resumed_from_is_saved(tmp_path):
    """`alchemist:adapter_saved_version` read -1 after every restart, and a shutdown with
    no new version logged and counted a save that wrote nothing (an outside pass)."""
    first = _training(tmp_path, save_every=1)
    serve(first, "r0")
    label(first, "r0")
    first.train_until_idle()
    first.close()
    second = _training(tmp_path, save_every=1)
    saves = second.status().saves
    assert (saves.last_saved_version, saves.saved) == (1, 0)
    checkpointer = second.lifecycle.checkpointer
    second.close()  # nothing new to save
    assert (checkpointer.saved, checkpointer.failed) == (0, 0)


def test_labels_in_the_saved_version_are_not_trained_again(tmp_path):
    first = _training(tmp_path, save_every=1)
    serve(first, "r0")
    label(first, "r0")
    first.train_until_idle()
    crash(first)
    second = _training(tmp_path, save_every=1)
    assert second.lifecycle.restored_from == 1 and second.cache.get("r0") is None
    assert not second.has_work() or not engine_of(second).has_unfinished()
    second.train_until_idle()
    assert second.stats.copy().trained_entries == {}
    second.close()


def test_a_deleted_label_is_still_said_deleted_after_a_restart(tmp_path):
    """The 404 says why, before and after a crash (an outside pass read "unknown" after)."""
    first = _training(tmp_path)
    for request_id in ("r0", "r1", "r2"):
        serve(first, request_id)
        label(first, request_id)
    assert first.forget("r0", label_only=True).found
    assert first.ledger.delete("r1", label_only=True).found  # killed before the cache withdrew its entry
    assert first.forget("r2").found  # the request whole (DELETE /v1/chat/completions/{id}): a README pass
    crash(first)
    second = _training(tmp_path)
    for request_id in ("r0", "r1", "r2"):
        assert second.cache.get(request_id) is None  # not waiting for a label again
        again = second.feedback.submit(FeedbackLabel(request_id, "A new label.", None, 0))
        assert again.outcome is FeedbackOutcome.UNKNOWN and "data were deleted" in again.message, again
    second.close()


@pytest.mark.parametrize("record_fraction", [1.0, 0.0], ids=["recorded", "not-recorded"])
def test_deleting_a_completion_still_being_generated_deletes_it_or_says_it_is_pending(tmp_path, record_fraction):
    """A stream's first chunk names the completion before it finishes: deleted then, an
    unrecorded one was "not found" (404) and then written to the ledger at its end, and took a
    label (a new pass). It is deleted (recorded: its entry exists) or 409 `response_pending`,
    and never in the ledger after a deletion was answered 200."""
    training = _training(tmp_path, config=dataclasses.replace(DPO, record_fraction=record_fraction))
    engine = engine_of(training)
    engine.add_request("r", encode("What is the capital of France?"),
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), train=True)
    engine.step()  # its prefill: decoding now
    forgotten = training.forget("r")
    assert forgotten.found != forgotten.pending, forgotten
    while engine.has_unfinished():
        engine.step()
    training.ledger.flush()
    if forgotten.found:
        assert "r" not in rows_by_id(tmp_path / LEDGER_FILE)
        assert training.feedback.submit(FeedbackLabel("r", "A new label.", None, 0)).outcome is FeedbackOutcome.UNKNOWN
    else:
        assert training.forget("r").found  # once finished, it is deleted
        assert "r" not in rows_by_id(tmp_path / LEDGER_FILE)
    training.close()


def test_a_label_deleted_after_it_trained_names_its_version_and_is_said_deleted_after_a_restart(tmp_path):
    """Its data go, its effect stays in the weights: the answer names the first version
    holding it, and a label sent again is told it was deleted, before and after a restart
    (an outside pass read 409 "already trained" before it and "unknown" after)."""
    app = tiny_app(train=DPO, adapter=AdapterConfig(dir=str(tmp_path), save_every=1))
    with TestClient(app) as client:
        trained, waiting = chat(client), chat(client)
        assert client.post("/v1/feedback", json={"id": trained, "chosen": "Paris."}).status_code == 200
        wait_for(lambda: client.get("/v1/adapters").json()["version"] == 1)
        app.state.alchemist.training.ledger.flush()
        for path in (f"/v1/feedback/{trained}", f"/v1/chat/completions/{waiting}"):
            r = client.delete(path)
            assert r.status_code == 200 and r.json()["trained_into_version"] == (1 if trained in path else None)
        r = client.post("/v1/feedback", json={"id": trained, "chosen": "Lyon."})
        assert r.status_code == 404 and "data were deleted" in r.json()["error"]["message"], r.text
    row = rows_by_id(tmp_path / LEDGER_FILE)[trained]
    assert row.label is None and (row.fate, row.fate_version) == ("trained", 1)  # it is in version 1
    with TestClient(tiny_app(train=DPO, adapter=AdapterConfig(dir=str(tmp_path), save_every=1))) as client:
        assert client.get("/v1/adapters").json()["restored_from"] == 1
        for completion_id in (trained, waiting):
            r = client.post("/v1/feedback", json={"id": completion_id, "chosen": "Lyon."})
            assert r.status_code == 404 and "data were deleted" in r.json()["error"]["message"], r.text


def test_a_label_deleted_while_it_trains_is_withdrawn_from_its_job_and_the_others_train(tmp_path):
    """DELETE /v1/feedback/{id} just after the label (an idle server starts its job at
    once): the job is dropped and its other entry requeued — the one half back-propagated
    recomputed — so the deleted label never reaches the weights (an outside pass had a 404
    and the label trained)."""
    training = _training(tmp_path)
    for request_id in ("kept", "deleted"):
        serve(training, request_id)
        label(training, request_id)
    run_into_a_backward(training)
    forgotten = training.forget("deleted", label_only=True)
    assert forgotten.found and forgotten.training == ["deleted"]  # the ledger's rows went; the entry trains
    assert training.withdraw_from_training(forgotten.training) == []  # none it could not withdraw
    assert training.cache.get("deleted") is None and training.cache.get("kept").state is EntryState.READY
    training.train_until_idle()
    assert sum(training.stats.copy().trained_entries.values()) == 1 and training.stats.failed_jobs == 0
    assert training.optimizer.version == 1
    again = training.feedback.submit(FeedbackLabel("deleted", "A new label.", None, 0))
    assert again.outcome is FeedbackOutcome.UNKNOWN and "deleted" in again.message
    training.ledger.flush()
    rows = rows_by_id(tmp_path / LEDGER_FILE)
    assert rows["kept"].fate == "trained" and rows["deleted"].label is None
    training.close()


def test_a_label_whose_step_was_applied_before_its_deletion_reached_the_job_is_reported(tmp_path):
    """The deletion reaches the device thread after the job's optimizer step: the label is
    in the weights, and withdrawing it says so (the route answers 409 label_in_training)."""
    training = _training(tmp_path)
    serve(training, "late")
    label(training, "late")
    run_into_a_backward(training)
    forgotten = training.forget("late", label_only=True)
    assert forgotten.training == ["late"]
    training.train_until_idle()  # the step lands first
    assert training.withdraw_from_training(forgotten.training) == ["late"]
    assert training.optimizer.version == 1
    again = training.feedback.submit(FeedbackLabel("late", "A new label.", None, 0))  # (was 409 "trained on")
    assert again.outcome is FeedbackOutcome.UNKNOWN and "deleted" in again.message, again.message
    training.close()


def test_a_label_whose_step_lands_while_its_deletion_is_written_is_reported(tmp_path):
    """The ledger's delete found it untrained, the step landed before the cache was asked:
    it is in the weights, and the answer says so (a review found a 200 that said it was in
    none)."""
    training = _training(tmp_path)
    serve(training, "late")
    label(training, "late")
    run_into_a_backward(training)
    delete = training.ledger.delete

    def delete_then_step(*args, **kwargs):
        deletion = delete(*args, **kwargs)
        training.train_until_idle()
        return deletion

    training.ledger.delete = delete_then_step
    forgotten = training.forget("late", label_only=True)
    assert forgotten.found and forgotten.training == ["late"] and forgotten.trained_into is None
    assert training.withdraw_from_training(forgotten.training) == ["late"]  # the route's 409 label_in_training
    training.close()


def test_a_label_sent_again_after_a_restart_is_told_it_exists_as_before_the_restart(tmp_path):
    """A client whose 200 a crash lost sends its label again: 409 label_exists, whether the
    label trained into the saved version (the restarted cache never knew the entry) or
    waits to train again; an id the ledger never held stays a 404 (an outside pass had 404)."""
    first = _training(tmp_path, save_every=1)
    for request_id in ("saved", "pending"):
        serve(first, request_id)
    label(first, "saved")
    first.train_until_idle()
    label(first, "pending")
    again = first.feedback.submit(FeedbackLabel("saved", "Lyon."))
    assert again.outcome is FeedbackOutcome.CONFLICT and again.code == "label_exists"
    crash(first)
    second = _training(tmp_path, save_every=1)
    assert second.cache.get("saved") is None and second.cache.get("pending") is not None
    for request_id, how in (("saved", "trained into version 1"), ("pending", "")):
        again = second.feedback.submit(FeedbackLabel(request_id, "Lyon."))
        assert again.outcome is FeedbackOutcome.CONFLICT and again.code == "label_exists", again
        assert how in again.message
    unknown = second.feedback.submit(FeedbackLabel("never-served", "Lyon."))
    assert unknown.outcome is FeedbackOutcome.UNKNOWN and unknown.code == "entry_not_found"
    second.close()


def test_a_list_of_one_prompt_named_as_prompt_0_is_the_same_completion_after_a_restart_and_to_delete(tmp_path):
    """A review: `<id>-0` was taken for a list of one prompt (entry `<id>`) only while this
    process's cache knew `<id>`; after a restart, a label sent again that way got 404, not
    409, and a deletion by that name found nothing."""
    first = _training(tmp_path, save_every=1)
    for request_id in ("cmpl-one", "cmpl-two"):
        serve(first, request_id)
        assert first.feedback.submit(FeedbackLabel(f"{request_id}-0", "Lyon.")).accepted
    first.train_until_idle()
    crash(first)
    second = _training(tmp_path, save_every=1)
    assert second.cache.get("cmpl-one") is None  # trained and saved: the restarted cache never knew it
    for name in ("cmpl-one", "cmpl-one-0"):
        again = second.feedback.submit(FeedbackLabel(name, "Lyon."))
        assert again.outcome is FeedbackOutcome.CONFLICT and "'cmpl-one'" in again.message, again
    assert second.forget("cmpl-two-0", label_only=True).found
    second.ledger.flush()
    assert rows_by_id(tmp_path / LEDGER_FILE)["cmpl-two"].label is None
    unknown = second.feedback.submit(FeedbackLabel("cmpl-none-0", "Lyon."))
    assert unknown.outcome is FeedbackOutcome.UNKNOWN
    second.close()


@pytest.mark.parametrize("restart", [False, True])
@pytest.mark.parametrize("label_only", [False, True])
def test_a_label_for_a_batchs_prompt_deleted_alone_is_told_it_was_deleted(tmp_path, restart, label_only):
    """With one prompt of a batch deleted alone (`<id>-0`, whole or its label), a label sent
    to the batch's id for that prompt's choice is told that prompt's data were deleted, in
    this process and after a restart; the batch's other prompt still takes its label."""
    training = _training(tmp_path, save_every=1)
    for prompt in range(2):
        serve(training, f"cmpl-x-{prompt}")
    if label_only:
        label(training, "cmpl-x-0")
    assert training.forget("cmpl-x-0", label_only=label_only).found
    if restart:
        crash(training)
        training = _training(tmp_path, save_every=1)
    refused = training.feedback.submit(FeedbackLabel("cmpl-x", "Lyon.", None, 0))
    assert refused.outcome is FeedbackOutcome.UNKNOWN and "'cmpl-x-0'" in refused.message, refused
    assert "were deleted" in refused.message, refused
    assert training.feedback.submit(FeedbackLabel("cmpl-x", "Lyon.", None, 1)).accepted
    training.close()


def test_a_label_sent_again_to_a_batch_of_prompts_after_a_restart_is_told_which_prompt_has_it(tmp_path):
    """A `/v1/completions` request of two prompts keeps an entry per prompt (`<id>-<i>`);
    both were labelled, trained and saved before the crash, so the restarted cache knows
    neither. A label sent again to the request's id is the label of the prompt its choice
    answers: 409, naming that prompt's entry (it was a 404); a choice past the batch's
    prompts stays a 404."""
    first = _training(tmp_path, save_every=1)
    for prompt in range(2):
        serve(first, f"cmpl-x-{prompt}")
        label(first, f"cmpl-x-{prompt}")
    first.train_until_idle()
    crash(first)
    second = _training(tmp_path, save_every=1)
    assert all(second.cache.get(f"cmpl-x-{prompt}") is None for prompt in range(2))
    for prompt in range(2):
        again = second.feedback.submit(FeedbackLabel("cmpl-x", "Lyon.", None, prompt))
        assert again.outcome is FeedbackOutcome.CONFLICT and again.code == "label_exists", again
        assert f"'cmpl-x-{prompt}'" in again.message and "trained into version" in again.message
    past = second.feedback.submit(FeedbackLabel("cmpl-x", "Lyon.", None, 2))
    assert past.outcome is FeedbackOutcome.UNKNOWN and past.code == "entry_not_found"
    second.close()


def test_group_rewards_survive_a_restart_and_train_with_the_served_log_probs(tmp_path):
    """And at the temperature they were taken at (the group's sampling temperature)."""
    from tests.test_grpo import reward, serve_group

    def grpo():
        return make_training(TrainConfig(mode="grpo", lora_rank=4), checkpointer=AdapterCheckpointer(
            AdapterStore(tmp_path), 10), ledger=Ledger(tmp_path / LEDGER_FILE))

    first = grpo()
    choices = serve_group(first, "g", temperature=0.7)
    served = {i: list(v) for i, v in first.cache.get("g").served_token_logps.items()}
    serve_group(first, "h", seed=2, temperature=1.3)
    assert reward(first, "g").accepted
    crash(first)

    second = grpo()
    entry = second.cache.get("g")
    assert entry.state.value == "ready" and entry.label.rewards == [1.0, 0.0, 0.5, 0.0]
    assert entry.responses == dict(enumerate(choices)) and entry.served_token_logps == served
    assert entry.logprob_temperature == 0.7 and second.cache.get("h").logprob_temperature == 1.3
    assert second.cache.get("h").state.value == "waiting_label"
    assert reward(second, "h", (0.0, 1.0, 0.0, 0.0)).accepted  # served before the crash, rewarded after it
    second.train_until_idle()
    assert second.stats.copy().trained_entries == {("grpo", "recompute"): 2}
    second.close()


def test_rewards_sent_to_a_batch_of_prompts_after_a_restart_are_refused_as_before_it(tmp_path):
    """A batch's rewards go to each prompt's id: sent to the batch's own id, a 400 that
    says so, before a restart and after it (when the cache no longer knows the batch)."""
    from tests.test_grpo import reward, serve_group

    def grpo():
        return make_training(TrainConfig(mode="grpo", lora_rank=4), checkpointer=AdapterCheckpointer(
            AdapterStore(tmp_path), 1), ledger=Ledger(tmp_path / LEDGER_FILE))

    first = grpo()
    for prompt in range(2):
        serve_group(first, f"cmpl-g-{prompt}", seed=prompt)
        assert reward(first, f"cmpl-g-{prompt}").accepted
    first.train_until_idle()
    crash(first)
    second = grpo()
    assert second.cache.get("cmpl-g-0") is None and second.cache.get("cmpl-g-1") is None
    refused = reward(second, "cmpl-g")
    assert refused.outcome is FeedbackOutcome.INVALID and "answered 2 prompts" in refused.message, refused
    second.close()


def serve_and_label(training, request_ids, train_each: bool = False) -> None:
    for request_id in request_ids:
        serve(training, request_id)
        label(training, request_id)
        if train_each:
            training.train_until_idle()


def test_a_label_deleted_after_it_trained_is_dropped_not_quarantined_when_a_rollback_undoes_it(tmp_path):
    """A deleted label that trained stays in the weights until a rollback undoes its
    version; then it is dropped for good, not quarantined, so that `feedback release`
    never brings it back to train (an outside pass had it take a new label, and train)."""
    first = _training(tmp_path, save_every=1)
    serve_and_label(first, ("deleted", "kept"))
    first.train_until_idle()
    assert first.optimizer.version == 1
    assert first.forget("deleted", label_only=True).found
    assert first.rollback(first.lifecycle.load_saved(0)) == 2
    first.ledger.flush()
    rows = rows_by_id(tmp_path / LEDGER_FILE)
    assert (rows["deleted"].fate, rows["deleted"].fate_reason) == ("dropped", "deleted")
    assert rows["kept"].fate == "quarantined"
    crash(first)
    assert len(release_quarantined(tmp_path / LEDGER_FILE)) == 1
    second = _training(tmp_path, save_every=1)
    again = second.feedback.submit(FeedbackLabel("deleted", "A new label.", None, 0))
    assert again.outcome is FeedbackOutcome.UNKNOWN and "data were deleted" in again.message, again
    second.train_until_idle()
    assert second.stats.copy().trained_entries == {("dpo", "recompute"): 1}  # the released one only
    second.close()


def test_a_rollback_killed_before_its_quarantine_landed_quarantines_at_the_restart(tmp_path):
    """The rollback's version is saved, then its quarantine is queued: a kill between the
    two left the undone versions' labels "trained", in no weights served (an outside pass
    found it). The restart, resuming at the rollback's version, quarantines them."""
    first = _training(tmp_path, save_every=1)
    serve_and_label(first, ("kept", "undone"), train_each=True)
    assert first.optimizer.version == 2
    first.ledger.rolled_back = lambda *args: None  # killed before it landed
    assert first.rollback(first.lifecycle.load_saved(1)) == 3
    crash(first)
    second = _training(tmp_path, save_every=1)
    assert second.optimizer.version == 3
    second.ledger.flush()
    rows = rows_by_id(tmp_path / LEDGER_FILE)
    assert (rows["kept"].fate, rows["undone"].fate) == ("trained", "quarantined")
    assert "rolled back to version 1, as version 3" in rows["undone"].fate_reason
    second.close()


def test_rollbacks_leave_trained_exactly_the_labels_the_served_weights_hold(tmp_path):
    """Weights go back, versions forward: 13 is a copy of 10 (11 and 12 quarantined), 14
    trains on it, 15 is a copy of 12 — which holds 11 and 12 again (trained, not left
    quarantined to train twice once released) but not 14 — and 16 a copy of 14, which holds
    1-10 and 14, not 11 and 12 (an outside pass had rollbacks only ever quarantine)."""
    ledger = Ledger(tmp_path / LEDGER_FILE)

    def trained_into(version):
        ledger.record_request(RequestRecord(f"r{version}", time.time(), 0, "dpo", [1, 2]))
        ledger.record_fate(f"r{version}", "trained", version)

    def fates():
        ledger.flush()
        return {row.request.id: row.fate for row in read_ledger(tmp_path / LEDGER_FILE)}

    for version in range(1, 13):
        trained_into(version)
    ledger.rolled_back(10, 13)
    assert {fates()[f"r{v}"] for v in (11, 12)} == {"quarantined"}
    trained_into(14)
    ledger.rolled_back(12, 15)
    assert (fates()["r11"], fates()["r12"], fates()["r14"]) == ("trained", "trained", "quarantined")
    ledger.rolled_back(14, 16)
    now = fates()
    assert {now[f"r{v}"] for v in range(1, 11)} == {"trained"} and now["r14"] == "trained"
    assert (now["r11"], now["r12"]) == ("quarantined", "quarantined")
    ledger.rolled_back(14, 16)  # again (a restart after a kill, another replica): nothing changes
    assert fates() == now
    ledger.close()
    # released, they wait to train again; a rollback to weights that hold them gives them back their fate
    # (a review: the release forgot their version, and they trained twice)
    assert release_quarantined(tmp_path / LEDGER_FILE, ["r11"]) == ["r11"]
    ledger = Ledger(tmp_path / LEDGER_FILE)
    ledger.rolled_back(12, 17)
    assert fates()["r11"] == "trained"
    assert {row.request.id: row.fate_version for row in read_ledger(tmp_path / LEDGER_FILE)}["r11"] == 11
    ledger.close()


def test_a_label_trained_again_after_a_release_is_held_by_weights_that_hold_either_training(tmp_path):
    """Trained into 1, quarantined by a rollback to 0 (as 2), released, trained again into 3:
    a rollback to 1 (as 4) restores weights that hold it. The ledger kept one version per
    label and forgot 1, so it quarantined the label (a second release trained it into the
    weights twice) and a deletion named no version holding it (an outside pass)."""
    ledger = Ledger(tmp_path / LEDGER_FILE)

    def fate():
        ledger.flush()
        row = {row.request.id: row for row in read_ledger(tmp_path / LEDGER_FILE)}["r"]
        return row.fate, row.fate_version

    ledger.record_request(RequestRecord("r", time.time(), 0, "dpo", [1, 2]))
    ledger.commit_label("r", LabelRecord("preference", chosen="a", rejected="b"))
    ledger.record_fate("r", "trained", 1)
    ledger.rolled_back(0, 2)
    assert fate() == ("quarantined", 1)
    ledger.close()
    assert release_quarantined(tmp_path / LEDGER_FILE) == ["r"]
    ledger = Ledger(tmp_path / LEDGER_FILE)
    ledger.record_fate("r", "trained", 3)
    ledger.rolled_back(1, 4)
    assert fate() == ("trained", 1)  # v4 is v1's weights: its first training
    assert ledger.stats.rollback_quarantined == 0
    ledger.rolled_back(3, 5)
    assert fate() == ("trained", 3)  # v3's lineage (3, then 2: a copy of 0) holds the second
    ledger.rolled_back(0, 6)
    assert fate() == ("quarantined", 3)  # neither
    ledger.rolled_back(1, 7)
    assert fate() == ("trained", 1)
    assert ledger.delete("r", label_only=True).trained_into == 1
    ledger.close()


def test_every_training_of_a_label_is_kept_however_it_came_to_train_again(tmp_path):
    """A review's cases: a released label given back `trained` by a rollback, which the
    cache then trains again; a deleted label whose last training left the weights; and a
    label the gate quarantined after an earlier training that a rollback restores."""
    ledger = Ledger(tmp_path / LEDGER_FILE)

    def fate(request_id):
        ledger.flush()
        row = {row.request.id: row for row in read_ledger(tmp_path / LEDGER_FILE)}[request_id]
        return row.fate, row.fate_version

    for request_id in ("cached", "deleted", "gated"):
        ledger.record_request(RequestRecord(request_id, time.time(), 0, "dpo", [1, 2]))
        ledger.commit_label(request_id, LabelRecord("preference", chosen="a", rejected="b"))
        ledger.record_fate(request_id, "trained", 1)
    ledger.rolled_back(0, 2)
    ledger.close()
    assert sorted(release_quarantined(tmp_path / LEDGER_FILE)) == ["cached", "deleted", "gated"]
    ledger = Ledger(tmp_path / LEDGER_FILE)
    ledger.rolled_back(1, 3)  # "cached" waits in the cache to train again; v3 holds its training
    assert fate("cached") == ("trained", 1)
    ledger.record_fate("cached", "trained", 4)  # the cache trained it again
    ledger.record_fate("deleted", "trained", 4)
    ledger.record_fate("gated", "trained", 4)
    ledger.delete("deleted", label_only=True)
    ledger.quarantine(["gated"], "eval gate rejected version 4", 5, 3)
    ledger.rolled_back(1, 6)  # v1's weights hold each one's first training
    assert (fate("cached"), fate("deleted"), fate("gated")) == (("trained", 1),) * 3
    ledger.close()


def test_a_restart_forgets_the_earlier_trainings_into_versions_it_lost(tmp_path):
    """A label trained into 3, quarantined, released and trained again: a crash that lost
    version 3 (the restart resumes 2's weights) leaves no earlier training in any weights."""
    ledger = Ledger(tmp_path / LEDGER_FILE)
    ledger.record_request(RequestRecord("r", time.time(), 0, "dpo", [1, 2]))
    ledger.record_fate("r", "trained", 3)
    ledger.rolled_back(2, 4)
    ledger.close()
    assert release_quarantined(tmp_path / LEDGER_FILE) == ["r"]
    ledger = Ledger(tmp_path / LEDGER_FILE)
    ledger.record_fate("r", "trained", 5)
    ledger.flush()
    conn = sqlite3.connect(tmp_path / LEDGER_FILE)
    assert list(conn.execute("SELECT request_id, version FROM earlier_trainings")) == [("r", 3)]
    ledger.resumed(2, 6)
    ledger.flush()
    assert list(conn.execute("SELECT request_id, version FROM earlier_trainings")) == []
    conn.close()
    ledger.close()


def _wait_for_queued(ledger: Ledger, writes: int) -> None:
    """Until the writer's queue holds `writes` writes (white-box: the interleaving the test needs)."""
    deadline = time.monotonic() + 30
    while ledger._queue.qsize() != writes:
        assert time.monotonic() < deadline, ledger._queue.qsize()
        time.sleep(0.005)


def _write_twice_in_a_failed_batch(tmp_path) -> None:
    """A rollback's write in a batch beside a label sent twice: the batch fails on the
    second label and each write is tried alone, so the rollback's runs twice; it counts
    what it quarantined once (a review found it counted twice)."""
    ledger = Ledger(tmp_path / LEDGER_FILE)
    ledger.record_request(RequestRecord("twice", time.time(), 0, "dpo", [1, 2]))
    ledger.record_fate("twice", "trained", 7)
    ledger.commit_label("twice", LabelRecord("preference", chosen="a", rejected="b"))
    blocker = sqlite3.connect(tmp_path / LEDGER_FILE, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    ledger.record_request(RequestRecord("first", time.time(), 0, "dpo", [1, 2]))
    _wait_for_queued(ledger, 0)  # the writer has taken this write
    time.sleep(0.05)  # and its batch (it drains the queue right after), and waits on the lock with it
    ledger.rolled_back(6, 8)  # undoes version 7
    outcome = []  # what the second commit raised (an assertion in the thread itself would be lost)

    def commit_again():
        try:
            ledger.commit_label("twice", LabelRecord("preference", chosen="a", rejected="c"))
        except Exception as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    again = threading.Thread(target=commit_again)
    again.start()
    _wait_for_queued(ledger, 2)  # both queued behind the waiting write: one batch
    blocker.execute("ROLLBACK")
    blocker.close()
    again.join(30)
    ledger.close()
    assert len(outcome) == 1 and isinstance(outcome[0], LabelExists), outcome
    assert ledger.stats.rollback_quarantined == 1


def test_a_rollbacks_number_is_given_to_no_other_weights_when_its_save_failed_and_a_kill_came(tmp_path):
    """A randomized test of the ledger: a rollback answered as version 2 whose save failed,
    nothing served or trained at 2, then a kill: the restart resumed version 1 under its own
    number and the next step was numbered 2 again — one number, two adapters."""
    first = _training(tmp_path, save_every=1)
    serve_and_label(first, ("a",), train_each=True)
    first.lifecycle.checkpointer.wait()

    def disk_full(snapshot):
        raise OSError("disk full")

    first.lifecycle.checkpointer.store.save = disk_full
    rolled = first.rollback(first.lifecycle.load_saved(0))
    assert rolled == 2
    crash(first)
    second = _training(tmp_path, save_every=1)
    assert second.optimizer.version == 3 and second.lifecycle.restored_from == 1
    serve_and_label(second, ("b",), train_each=True)
    assert second.optimizer.version == 4
    second.close()


def test_a_rollback_quarantines_only_the_versions_it_undid(tmp_path):
    """Restoring version 2 as version 5 undoes versions 3 and 4; what trained into version
    5 or later (another replica may apply the same rollback later) is left alone."""
    ledger = Ledger(tmp_path / LEDGER_FILE)
    for version in range(1, 7):
        ledger.record_request(RequestRecord(f"r{version}", float(version), 0, "dpo", [1, 2]))
        ledger.record_fate(f"r{version}", "trained", version)
    ledger.rolled_back(2, 5)
    ledger.close()
    fates = {row.request.id: row.fate for row in read_ledger(tmp_path / LEDGER_FILE)}
    assert fates == {"r1": "trained", "r2": "trained", "r3": "quarantined", "r4": "quarantined",
                     "r5": "trained", "r6": "trained"}
    assert ledger.stats.rollback_quarantined == 2
    _write_twice_in_a_failed_batch(tmp_path)
    again = Ledger(tmp_path / LEDGER_FILE)  # the same rollback applied again (a restart, another replica)
    again.rolled_back(2, 5)
    again.close()
    assert again.stats.rollback_quarantined == 0


def released_after_a_rollback(root) -> None:
    """Label "r" trained into version 1, quarantined by a rollback to 0 (as version 2), then
    released: the next start queues it to train again."""
    first = _training(root, save_every=1)
    serve_and_label(first, ("r",), train_each=True)
    assert first.optimizer.version == 1
    assert first.rollback(first.lifecycle.load_saved(0)) == 2
    crash(first)
    assert release_quarantined(root / LEDGER_FILE) == ["r"]


def assert_held_not_trained_again(training, root) -> None:
    """The weights hold "r" through its training into version 1: nothing trains it again,
    and the ledger says so."""
    training.train_until_idle()
    assert training.stats.copy().trained_entries == {}
    training.ledger.flush()
    row = rows_by_id(root / LEDGER_FILE)["r"]
    assert (row.fate, row.fate_version) == ("trained", 1)


@pytest.mark.parametrize("lost_retraining", [False, True], ids=["released", "released-retrained-lost"])
def test_a_released_label_the_restored_weights_hold_already_is_not_trained_again(tmp_path, lost_retraining):
    """Trained into 1, quarantined by a rollback to 0, released: it waits in the cache to
    train again; a rollback to 1 restores weights that hold it. The ledger gave it back its
    `trained` but the cache trained it anyway, into the weights twice; and where it had
    trained again into a version a crash lost, the restart cleared its release and its
    earlier version, so the rollback did not even give it back (a review found both)."""
    released_after_a_rollback(tmp_path)
    if lost_retraining:
        second = _training(tmp_path, save_every=100)
        second.train_until_idle()  # trains it again, into version 3, which the crash loses
        assert second.optimizer.version == 3 and second.lifecycle.checkpointer.last_saved_version == 2
        crash(second)
    last = _training(tmp_path, save_every=1)
    last.ledger.flush()
    row = rows_by_id(tmp_path / LEDGER_FILE)["r"]
    assert (row.fate, row.fate_version, row.fate_reason) == (None, 1, "released")
    assert last.cache.get("r") is not None  # waits to train again
    last.rollback(last.lifecycle.load_saved(1))
    assert last.cache.get("r") is None
    assert_held_not_trained_again(last, tmp_path)
    assert last.feedback.submit(FeedbackLabel("r", "Another label.", None, 0)).outcome is not FeedbackOutcome.ACCEPTED
    last.close()


def first_save_fails(training) -> list[int]:
    """The next save of `training`'s checkpointer fails (a full disk), the later ones save;
    the versions it was asked to save."""
    store, saves = training.lifecycle.checkpointer.store, []
    plain_save = store.save

    def save_once_failing(snapshot):
        saves.append(snapshot.version)
        if len(saves) == 1:
            raise OSError("disk full")
        return plain_save(snapshot)

    store.save = save_once_failing
    return saves


@pytest.mark.parametrize("after", ["saved-later", "killed"])
def test_a_rollback_whose_save_failed_lets_go_at_once_of_the_label_its_weights_hold(tmp_path, after):
    """The rollback serves but its save failed: its fates follow the weights that serve at
    once (they waited for the next version saved, and meanwhile the queue trained the
    released label the restored weights hold into them a second time: a randomized test of
    the ledger). A later save carries it; a kill before one resumes the saved version,
    which does not hold the label: quarantined then, not `trained` by weights that are gone."""
    released_after_a_rollback(tmp_path)
    last = _training(tmp_path, save_every=1)
    saves = first_save_fails(last)
    assert last.rollback(last.lifecycle.load_saved(1)) == 3
    assert saves == [3] and last.cache.get("r") is None
    assert_held_not_trained_again(last, tmp_path)
    carried = last.lifecycle.snapshot()
    assert carried.state["rollbacks"] == [[1, 3]]
    if after == "saved-later":
        last.lifecycle._save(carried)  # the next version saved (a due save, the gate's promotion) carries it
        wait_for(lambda: not last.lifecycle.snapshot().state.get("rollbacks"), timeout=30)
        assert saves == [3, 3]
        assert_held_not_trained_again(last, tmp_path)
        last.close()
        return
    crash(last)
    again = _training(tmp_path, save_every=1)
    assert (again.lifecycle.restored_from, again.optimizer.version) == (2, 4)  # v2: a copy of v0
    again.ledger.flush()
    row = rows_by_id(tmp_path / LEDGER_FILE)["r"]
    assert (row.fate, row.fate_version) == ("quarantined", 1)
    assert row.fate_reason.startswith("resumed saved version 2 as version 4")
    assert again.cache.get("r") is None
    again.close()


def test_a_rollback_killed_before_its_fates_landed_gives_them_back_before_the_restart_replays(tmp_path):
    """The restart applies the rollback's fates again, queued; the replay read the ledger
    before they landed, and put the released label that the restored weights hold back in
    line to train a second time (a review found it)."""
    released_after_a_rollback(tmp_path)
    second = _training(tmp_path, save_every=1)
    assert second.cache.get("r") is not None
    second.ledger.rolled_back = lambda *args: None  # killed before the rollback's fates landed
    assert second.rollback(second.lifecycle.load_saved(1)) == 3
    assert second.cache.get("r") is not None  # nothing given back yet
    crash(second)
    third = _training(tmp_path, save_every=1)
    assert third.optimizer.version == 3 and third.cache.get("r") is None
    assert_held_not_trained_again(third, tmp_path)
    third.close()


def test_a_rollback_applied_again_after_a_release_changes_nothing(tmp_path):
    """Two rollbacks a save carried (to 1 as 2, to 0 as 3) quarantined "r"; released while
    the server was down. The restart applies the saved version's rollbacks again, in order:
    the first gave the released label back `trained` (v1 holds it), the second quarantined
    it, and the release was silently undone (a randomized test of the ledger)."""
    path = tmp_path / LEDGER_FILE

    def fate():
        ledger.flush()
        row = rows_by_id(path)["r"]
        return row.fate, row.fate_version, row.fate_reason

    ledger = Ledger(path)
    ledger.record_request(RequestRecord("r", time.time(), 0, "dpo", [1, 2]))
    ledger.commit_label("r", LabelRecord("preference", chosen="a", rejected="b"))
    ledger.record_fate("r", "trained", 1)
    ledger.rolled_back(1, 2)
    ledger.rolled_back(0, 3)
    assert fate()[0] == "quarantined"
    ledger.close()
    assert release_quarantined(path) == ["r"]
    ledger = Ledger(path)
    ledger.rolled_back(1, 2)
    ledger.rolled_back(0, 3)
    assert fate() == (None, 1, "released")
    ledger.close()


def test_fates_a_replica_wrote_before_rank_0_saved_the_rollback_follow_the_weights_a_restart_resumes(tmp_path):
    """A replica that saves no version writes a rollback's fates when it applies the round;
    rank 0 saves the rollback later. Killed between, the restart resumes the last saved
    version, whose weights hold the labels the ledger had quarantined: `feedback release`
    would have trained them twice (a review of the replicas' protocol). The ledger's fates
    follow the weights resumed."""
    rank0 = _training(tmp_path, save_every=1)
    rank1 = make_training(DPO, ledger=Ledger(tmp_path / LEDGER_FILE))  # the same node: the same ledger
    serve_and_label(rank0, ("a", "b"), train_each=True)
    crash(rank0)
    assert rank0.optimizer.version == 2
    rank1.lifecycle.restore(rank0.lifecycle.snapshot(), 2)
    assert rank1.lifecycle.rollback_saved_later(rank0.lifecycle.load_saved(0)) == (3, None)
    rank1.ledger.flush()
    assert {row.fate for row in rows_by_id(tmp_path / LEDGER_FILE).values()} == {"quarantined"}
    crash(rank1)
    again = _training(tmp_path, save_every=1)
    assert (again.lifecycle.restored_from, again.optimizer.version) == (2, 4)
    again.ledger.flush()
    rows = rows_by_id(tmp_path / LEDGER_FILE)
    assert {(rid, row.fate, row.fate_version) for rid, row in rows.items()} == {("a", "trained", 1),
                                                                                ("b", "trained", 2)}
    again.close()
    assert release_quarantined(tmp_path / LEDGER_FILE) == []


def test_a_label_deleted_after_it_trained_is_named_in_the_weights_a_rollback_brings_back(tmp_path):
    """Deleted after its training into 1, dropped by a rollback to 0 (as 2): a rollback to 1
    (as 3) brings its training back into the weights that serve, but it stayed `dropped`,
    and deleting the request then answered `trained_into_version: null` ("in no weights",
    README) though version 3 holds it (a randomized test of the ledger). It reads trained
    into 1 again, and never trains again."""
    ledger = Ledger(tmp_path / LEDGER_FILE)
    ledger.record_request(RequestRecord("r", time.time(), 0, "dpo", [1, 2]))
    ledger.commit_label("r", LabelRecord("preference", chosen="a", rejected="b"))
    ledger.record_fate("r", "trained", 1)
    assert ledger.delete("r", label_only=True).trained_into == 1
    ledger.rolled_back(0, 2)
    ledger.flush()
    assert (rows_by_id(tmp_path / LEDGER_FILE)["r"].fate, ledger.stats.rollback_quarantined) == ("dropped", 0)
    ledger.rolled_back(1, 3)
    ledger.flush()
    assert rows_by_id(tmp_path / LEDGER_FILE)["r"].fate == "trained"
    ledger.rolled_back(0, 4)
    ledger.flush()
    assert rows_by_id(tmp_path / LEDGER_FILE)["r"].fate == "dropped"
    ledger.rolled_back(3, 5)
    assert ledger.delete("r").trained_into == 1
    ledger.close()


def test_labels_a_crash_took_back_train_after_a_start_in_another_mode_saved_a_version(tmp_path, caplog):
    """DPO labels trained into a version a crash lost, then a start in GRPO mode, which
    saves a version of its own at its stop: the labels are untrained again at that start
    whatever the mode, so the next DPO start trains them (an outside pass found them left
    `trained` into the lost version, which the GRPO start's saved version then passed for
    one holding them: never trained again); the GRPO start says they wait for their mode."""
    first = _training(tmp_path, save_every=100)
    serve_and_label(first, ("r0", "r1"))
    first.train_until_idle()
    assert first.optimizer.version == 1 and first.lifecycle.checkpointer.last_saved_version == 0
    crash(first)
    other = _training(tmp_path, save_every=100, config=TrainConfig(mode="grpo", lora_rank=4))
    assert "labels of another training method wait to be trained (dpo: 2)" in caplog.text
    other.close()  # saves the version it resumed at, which holds neither label
    back = _training(tmp_path)
    assert back.lifecycle.restored_from == 2
    assert {back.cache.get(r).state.value for r in ("r0", "r1")} == {"ready"}
    back.train_until_idle()
    assert back.stats.copy().trained_entries == {("dpo", "recompute"): 2}
    back.close()
