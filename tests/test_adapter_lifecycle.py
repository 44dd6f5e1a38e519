"""Saved adapter versions: PEFT's format, atomic saves, resume on restart, rollback, and
a SIGKILL in the middle of a save."""

import dataclasses
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient
from peft import PeftModel, get_peft_model_state_dict

from bench.report import read_metric
from trainer.config import AdapterConfig, TrainConfig
from tests.servers import TINY_NAME, tiny_app, wait_for
from tests.conftest import make_training, run_into_a_backward
from tests.test_training import label, make_trainer, serve
from tests.tiny import tiny_model
from trainer.adapter_store import AdapterMismatchError, AdapterStore
from trainer.ledger_db import LEDGER_FILE, read_ledger

TRAIN = TrainConfig(mode="cpt", lora_rank=4, learning_rate=1e-2)


def serve_and_train(client, prompts):
    """Serves each prompt (greedy) and waits until its entry is trained; returns the texts."""
    texts = []
    for prompt in prompts:
        before = client.get("/v1/adapters").json()["version"]
        r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": prompt, "max_tokens": 6,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
        wait_for(lambda: client.get("/v1/adapters").json()["version"] > before)
    return texts


def complete(client, prompt="the quick brown fox", train=False):
    r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": prompt, "max_tokens": 8,
                                             "temperature": 0, "train": train})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_restart_resumes_the_version_and_the_saved_adapter_loads_in_peft(tmp_path):
    adapter = AdapterConfig(dir=str(tmp_path), save_every=2, keep=10)
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:
        status = client.get("/v1/adapters").json()
        assert status["version"] == 0 and [v["version"] for v in status["saved"]] == [0]
        serve_and_train(client, [f"prompt number {i} about cats" for i in range(3)])
        reference = complete(client)
        state = client.app.state.alchemist
        live = {k: v.detach().clone() for k, v in state.training.peft_model.named_parameters() if "lora_" in k}
    # shutdown saved the final version (3), beside the periodic one (2) and the initial one (0)
    assert [v.version for v in AdapterStore(tmp_path).versions()] == [0, 2, 3]

    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:
        status = client.get("/v1/adapters").json()
        assert status["version"] == 3 and status["restored_from"] == 3
        assert json.loads((tmp_path / "v00000003" / "alchemist_state.json").read_text())["entries_in_weights"] == 3
        assert complete(client) == reference  # the same adapter serves the same tokens
        resumed = client.app.state.alchemist.training
        assert resumed.optimizer.optimizer.state  # AdamW's moments came back too
        serve_and_train(client, ["one more prompt"])
        assert client.get("/v1/adapters").json()["version"] == 4
    # the entries in each version's weights, across the restart
    assert json.loads((tmp_path / "v00000004" / "alchemist_state.json").read_text())["entries_in_weights"] == 4

    # PEFT loads a saved version as it is, and computes what the server computed
    peft = PeftModel.from_pretrained(tiny_model("llama"), str(tmp_path / "v00000003"))
    loaded = {k.replace(".default", ""): v for k, v in peft.named_parameters() if "lora_" in k}
    assert set(loaded) == {k.replace(".default", "") for k in live}
    for name, tensor in live.items():
        assert torch.equal(loaded[name.replace(".default", "")], tensor), name


def test_rollback_restores_a_saved_version_as_a_new_version(tmp_path):
    adapter = AdapterConfig(dir=str(tmp_path), save_every=1, keep=10)
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:
        serve_and_train(client, ["first prompt about dogs"])
        at_v1 = complete(client)
        serve_and_train(client, ["second prompt about birds", "third prompt about fish"])
        assert client.get("/v1/adapters").json()["version"] == 3
        assert complete(client) != at_v1  # training at lr 1e-2 moved the tokens

        r = client.post("/v1/adapters/rollback", json={"version": 1})
        assert r.status_code == 200, r.text
        status = r.json()
        assert status["version"] == 4 and status["restored_from"] == 1
        assert json.loads((tmp_path / "v00000004" / "alchemist_state.json").read_text())["entries_in_weights"] == 1
        assert (tmp_path / "v00000004" / "adapter_model.safetensors").is_file()  # saved before the answer
        assert [v["version"] for v in status["saved"]] == [0, 1, 2, 3, 4]
        assert complete(client) == at_v1
        training = client.app.state.alchemist.training
        training.ledger.flush()
        fates = {row.request.prompt: (row.fate, row.fate_version) for row in read_ledger(tmp_path / LEDGER_FILE)}
        assert fates["first prompt about dogs"] == ("trained", 1)
        for undone in ("second prompt about birds", "third prompt about fish"):  # `feedback release` retrains them
            assert fates[undone][0] == "quarantined", fates
        metrics = client.get("/metrics").text  # counted (an outside pass found them in the ledger only)
        assert 'alchemist:quarantined_labels_total{reason="manual"} 2.0' in metrics
        assert 'alchemist:quarantined_labels_total{reason="eval_gate"} 0.0' in metrics

        r = client.post("/v1/adapters/rollback", json={"version": 99})
        assert r.status_code == 404 and r.json()["error"]["code"] == "version_not_found"
        for body in ({}, {"version": -1}, {"version": "1"}, {"version": 1, "x": 2}):
            r = client.post("/v1/adapters/rollback", json=body)
            assert r.status_code == 400, body
        # training goes on after a rollback
        serve_and_train(client, ["fourth prompt about mice"])
        assert client.get("/v1/adapters").json()["version"] == 5


def test_a_rollback_retried_after_its_version_was_pruned_for_the_copy_restores_the_same_weights(tmp_path):
    """An outside pass: with `keep` versions saved, a rollback to version 2 saves its copy,
    and version 2 gives way to it (copies go first); the client's retry got 404."""
    adapter = AdapterConfig(dir=str(tmp_path), save_every=1, keep=3)
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:
        serve_and_train(client, ["first prompt about dogs", "second prompt about birds"])
        at_v2 = complete(client)
        serve_and_train(client, ["third prompt about fish"])
        first = client.post("/v1/adapters/rollback", json={"version": 2})
        assert first.status_code == 200 and first.json()["version"] == 4, first.text
        assert [v["version"] for v in first.json()["saved"]] == [1, 3, 4]  # version 2's weights: in version 4
        retried = client.post("/v1/adapters/rollback", json={"version": 2})
        assert retried.status_code == 200, retried.text
        assert retried.json()["version"] == 5 and retried.json()["restored_from"] == 4
        assert complete(client) == at_v2
        assert client.post("/v1/adapters/rollback", json={"version": 0}).status_code == 404  # pruned, no copy


def test_a_pruned_copy_is_still_a_version_to_roll_back_to_and_to_serve_and_an_unreadable_holder_is_409(tmp_path):
    """A copy gives way to the version it copied (kept while on disk): a rollback to the
    copy's own number got 404, and so did `--adapter-version` (noticed and left last time);
    a version whose weights' holder cannot be read got 404 too, where 409 says so."""
    adapter = AdapterConfig(dir=str(tmp_path), save_every=1, keep=4)
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:
        at_v0 = complete(client)
        serve_and_train(client, ["first prompt about dogs", "second prompt about birds"])
        assert client.post("/v1/adapters/rollback", json={"version": 0}).json()["version"] == 3  # a copy of 0
        serve_and_train(client, ["third prompt about fish"])
        wait_for(lambda: [v["version"] for v in client.get("/v1/adapters").json()["saved"]] == [0, 1, 2, 4])
        r = client.post("/v1/adapters/rollback", json={"version": 3})
        assert r.status_code == 200, r.text
        assert r.json()["version"] == 5 and r.json()["restored_from"] == 0
        assert complete(client) == at_v0
        with TestClient(tiny_app(adapter=AdapterConfig(dir=str(tmp_path), version=3))) as frozen:  # read only
            assert complete(frozen) == at_v0 and frozen.get("/v1/adapters").json()["version"] == 5
        assert client.post("/v1/adapters/rollback", json={"version": 99}).status_code == 404
        (tmp_path / "v00000005" / "adapter_model.safetensors").write_bytes(b"not safetensors")  # 0's weights: in 5
        for asked in (0, 3, 5):
            r = client.post("/v1/adapters/rollback", json={"version": asked})
            assert r.status_code == 409 and r.json()["error"]["code"] == "version_unreadable", r.text
        with pytest.raises(ValueError, match="cannot be served"):
            tiny_app(adapter=AdapterConfig(dir=str(tmp_path), version=3))


def test_a_rollbacks_answer_names_its_own_version_though_steps_trained_on_top_of_it(tmp_path, monkeypatch):
    """An outside chaos pass over `-dp 2`: the answer read the adapter's status after the
    rollback, when the replicas' rounds had often stepped it on (version 11, "restored_from":
    5, where the rollback had made version 9). Here the status read after it says so."""
    import server.routes_admin as routes_admin

    adapter = AdapterConfig(dir=str(tmp_path), save_every=1, keep=10)
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:
        serve_and_train(client, ["first prompt about dogs", "second prompt about birds"])
        status = routes_admin.adapter_status
        monkeypatch.setattr(routes_admin, "adapter_status", lambda state: {**status(state), "version": 7,
                                                                              "restored_from": None})
        r = client.post("/v1/adapters/rollback", json={"version": 1})
        assert r.status_code == 200, r.text
        assert (r.json()["version"], r.json()["restored_from"]) == (3, 1)
        assert 3 in [v["version"] for v in r.json()["saved"]]


def test_a_rollback_a_later_one_superseded_before_it_reached_the_replicas_is_a_409_saying_so(tmp_path, monkeypatch):
    """An outside pass: under replicas it was a 503 "the rollback did not reach every replica"."""
    import concurrent.futures

    from trainer.online import OnlineTraining
    from trainer.replicated import RollbackSuperseded

    def superseded(training, snapshot):
        future = concurrent.futures.Future()
        future.set_exception(RollbackSuperseded("a later rollback, to version 0, … superseded it"))
        return future

    monkeypatch.setattr(OnlineTraining, "rollback", superseded)
    with TestClient(tiny_app(train=TRAIN, adapter=AdapterConfig(dir=str(tmp_path)))) as client:
        r = client.post("/v1/adapters/rollback", json={"version": 0})
        assert r.status_code == 409 and r.json()["error"]["code"] == "rollback_superseded", r.text


def test_a_rollback_to_a_version_whose_save_is_in_flight_waits_for_it(tmp_path, monkeypatch):
    """Saves run in the background: a rollback asked for right after a version trained found
    it "not saved" while its save was still on its way to disk (a 404 in one CI run)."""
    adapter = AdapterConfig(dir=str(tmp_path), save_every=1, keep=10)
    slow_save = AdapterStore.save

    def save(store, snapshot):
        time.sleep(1.0)
        return slow_save(store, snapshot)

    monkeypatch.setattr(AdapterStore, "save", save)
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:
        serve_and_train(client, ["first prompt about dogs"])  # version 1's save then sleeps a second
        r = client.post("/v1/adapters/rollback", json={"version": 1})
        assert r.status_code == 200, r.text
        assert r.json()["restored_from"] == 1


def test_a_rollback_whose_save_failed_serves_and_is_recorded_by_the_next_version_saved_and_a_restart_at_it(
        tmp_path):
    """The fates follow the weights that serve: the labels it undid are quarantined at once
    (a restart before a later save resumes the weights before it, and the ledger follows
    them: tests/test_ledger.py), and the answer's saved list says it is not saved. A later
    version saved carries it, and a restart at that version applies its fates again if a
    kill lost them."""
    adapter = AdapterConfig(dir=str(tmp_path), save_every=1, keep=10)
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:
        serve_and_train(client, ["first prompt about dogs"])
        serve_and_train(client, ["second prompt about birds"])
        training = client.app.state.alchemist.training
        store = training.lifecycle.checkpointer.store
        save = store.save

        def full_disk(snapshot):
            raise OSError("No space left on device")

        store.save = full_disk
        r = client.post("/v1/adapters/rollback", json={"version": 1})
        assert r.status_code == 200 and r.json()["version"] == 3, r.text
        assert 3 not in [v["version"] for v in r.json()["saved"]]
        training.ledger.flush()
        fates = {row.request.prompt: row.fate for row in read_ledger(tmp_path / LEDGER_FILE)}
        assert fates["second prompt about birds"] == "quarantined"
        store.save = save  # room again
        serve_and_train(client, ["third prompt about cats"])  # version 4, saved, carries the rollback
        training.lifecycle.checkpointer.wait()
        assert json.loads((store.path_of(4) / "alchemist_state.json").read_text())["rollbacks"] == [[1, 3]]
        training.ledger.flush()
        fates = {row.request.prompt: (row.fate, row.fate_version) for row in read_ledger(tmp_path / LEDGER_FILE)}
        assert fates["second prompt about birds"][0] == "quarantined"
        assert fates["first prompt about dogs"] == ("trained", 1) and fates["third prompt about cats"][0] == "trained"
    with sqlite3.connect(tmp_path / LEDGER_FILE) as conn:  # as if a kill came before those fates were written
        conn.execute("UPDATE requests SET fate = 'trained', fate_reason = NULL WHERE fate = 'quarantined'")
        conn.execute("DELETE FROM versions WHERE version = 3")  # (written in the same transaction)
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:  # resumes version 4, which carries it
        training = client.app.state.alchemist.training
        training.ledger.flush()
        fates = {row.request.prompt: row.fate for row in read_ledger(tmp_path / LEDGER_FILE)}
        assert fates["second prompt about birds"] == "quarantined"
        serve_and_train(client, ["fourth prompt about mice"])
        training.lifecycle.checkpointer.wait()
        assert "rollbacks" not in json.loads((store.path_of(5) / "alchemist_state.json").read_text())


def test_a_rollback_saved_later_serves_at_once_is_carried_until_its_save_lands_and_quarantines_after(tmp_path):
    """Replicas' rank 0 does not wait for a rollback's save (that save waits for every
    replica's fates: trainer/replica_fates.py): the rollback serves at once, a snapshot
    taken meanwhile carries it, and the labels it undid are quarantined once it is saved."""
    adapter = AdapterConfig(dir=str(tmp_path), save_every=1, keep=10)
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:
        serve_and_train(client, ["first prompt about dogs"])
        serve_and_train(client, ["second prompt about birds"])
        state = client.app.state.alchemist
        training, lifecycle = state.training, state.training.lifecycle
        on_device = lambda fn, *args: client.portal.call(state.engine.run_on_device, fn, *args)  # noqa: E731
        snapshot = lifecycle.load_saved(1)
        store, released = lifecycle.checkpointer.store, threading.Event()
        save = store.save
        store.save = lambda rolled_back: released.wait(30) and save(rolled_back)

        def fates():
            training.ledger.flush()
            return {row.request.prompt: row.fate for row in read_ledger(tmp_path / LEDGER_FILE)}

        version, landing = on_device(lifecycle.rollback_saved_later, snapshot)
        assert version == 3 and not landing.done() and lifecycle.rollback_saving()
        assert on_device(lifecycle.snapshot).state["rollbacks"] == [[1, 3]]
        assert fates()["second prompt about birds"] == "trained"  # not before it is saved
        # serving goes on, but no job starts before the save lets go of what the restored weights hold
        assert complete(client, "third prompt about cats", train=True)
        time.sleep(1.0)
        assert training.optimizer.version == 3 and len(training.cache.entries()) == 1
        released.set()
        assert landing.result(30) is True and not lifecycle.rollback_saving()
        assert fates()["second prompt about birds"] == "quarantined"
        assert "rollbacks" not in on_device(lifecycle.snapshot).state
        assert json.loads((store.path_of(3) / "alchemist_state.json").read_text())["rolled_back_to"] == 1
        wait_for(lambda: training.optimizer.version == 4)  # the job waited, and ran


def test_a_rollback_whose_fates_fail_after_its_save_is_answered_with_the_error_and_training_goes_on(tmp_path):
    """The save's callback writes the rollback's fates: if that raises, whoever waits for
    the rollback hears it (rather than waiting for ever), and jobs start again."""
    adapter = AdapterConfig(dir=str(tmp_path), save_every=1, keep=10)
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:
        serve_and_train(client, ["first prompt about dogs"])
        state = client.app.state.alchemist
        lifecycle = state.training.lifecycle

        def ledger_gone(*args):
            raise TimeoutError("the ledger's writer did not answer")

        lifecycle._ledger_after_rollback = ledger_gone
        version, landing = client.portal.call(state.engine.run_on_device, lifecycle.rollback_saved_later,
                                              lifecycle.load_saved(0))
        assert isinstance(landing.exception(30), TimeoutError) and not lifecycle.rollback_saving()
        del lifecycle._ledger_after_rollback  # the ledger answers again: the next save carries the rollback
        serve_and_train(client, ["second prompt about birds"])  # a job ran after it


def test_adapter_routes_explain_when_saving_is_off():
    with TestClient(tiny_app(train=TRAIN)) as client:
        status = client.get("/v1/adapters").json()
        assert status["version"] == 0 and status["saved"] == [] and status["adapter_dir"] is None
        r = client.post("/v1/adapters/rollback", json={"version": 0})
        assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_dir_not_set"


def test_a_saved_adapter_of_another_rank_is_a_clear_startup_error(tmp_path):
    adapter = AdapterConfig(dir=str(tmp_path))
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)):
        pass
    with pytest.raises(ValueError, match="does not fit.*r 4 \\(configured: 8\\)"):
        tiny_app(train=TrainConfig(mode="cpt", lora_rank=8), adapter=adapter)


def test_unreadable_latest_version_falls_back_to_the_previous_one(tmp_path):
    adapter = AdapterConfig(dir=str(tmp_path), save_every=1, keep=10)
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:
        serve_and_train(client, ["a prompt", "another prompt"])
    (tmp_path / "v00000002" / "adapter_model.safetensors").write_bytes(b"damaged")
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:
        status = client.get("/v1/adapters").json()  # version 1's weights, under a number version 2 never had
        assert (status["version"], status["restored_from"]) == (3, 1)
        serve_and_train(client, ["a third prompt"])
        # the request trained into the lost version 2 is taken back from the ledger and trains again: with
        # the new one in one step, or alone first (before the new one is ready), then versions 4 and 5
        wait_for(lambda: read_metric(client.get("/metrics").text,
                                     'alchemist:activation_cache_ended_entries_total{state="trained"}') == 2,
                 poll_s=0.1)
        last = client.get("/v1/adapters").json()["version"]
    assert last in (4, 5)
    assert [p.name.split("-")[0] for p in tmp_path.glob("v00000002.unreadable-*")] == ["v00000002.unreadable"]
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:
        assert client.get("/v1/adapters").json()["restored_from"] == last


_SAVE_LOOP = textwrap.dedent("""
    import sys, torch
    from peft import LoraConfig
    from trainer.adapter_store import AdapterSnapshot, AdapterStore
    store = AdapterStore(sys.argv[1], keep=1000)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    version = 0
    while True:  # big enough files that a kill often lands mid-write
        weights = {f"base_model.model.layers.{i}.q_proj.lora_A.weight": torch.full((4, 4096), float(version))
                   for i in range(16)}
        store.save(AdapterSnapshot(version, weights, config, {"state": {}, "param_groups": []}))
        print(version, flush=True)
        version += 1
""")


@pytest.mark.slow  # four processes, each saving until it is killed
def test_sigkill_mid_save_never_leaves_a_version_that_fails_to_load(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rng = random.Random(0)
    interrupted = 0
    for attempt in range(4):
        root = tmp_path / f"run{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", _SAVE_LOOP, str(root)], cwd=repo, stdout=subprocess.PIPE,
                                text=True)
        lines = [proc.stdout.readline() for _ in range(3)]
        assert all(lines), "the save loop died"
        started = time.perf_counter()
        lines.append(proc.stdout.readline())
        time.sleep(rng.uniform(0, time.perf_counter() - started))  # somewhere inside the next save
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        interrupted += bool(list(root.glob(".tmp-*")))
        store = AdapterStore(root, keep=1000)  # a new start clears interrupted saves
        assert not list(root.glob(".tmp-*"))
        versions = [v.version for v in store.versions()]
        assert versions[: len(lines)] == list(range(len(lines)))
        for version in versions:  # every version left behind loads, with its own contents
            snapshot = store.load(version)
            assert all(float(t[0, 0]) == version for t in snapshot.weights.values())
        assert store.latest().version == versions[-1]
    assert interrupted >= 1, "no kill landed inside a save"


def test_rollback_in_the_middle_of_a_job_requeues_its_entry_on_the_recompute_path():
    trainer = make_trainer()
    serve(trainer, "a")
    trainer.train_until_idle()
    snapshot_v1 = trainer.lifecycle.snapshot()
    serve(trainer, "b", prompt="Hello, how are you today? I am fine.")
    for _ in range(3):  # the job for "b" is under way
        assert trainer.run_slice()
    assert trainer.trainer.in_job()
    assert trainer.rollback(snapshot_v1) == 2
    assert not trainer.trainer.in_job() and trainer.cache.get("b").state.value == "ready"
    assert all(p.grad is None for p in trainer.optimizer.params)  # the half-done job's gradients are gone
    live = get_peft_model_state_dict(trainer.peft_model)
    for name, tensor in snapshot_v1.weights.items():
        assert torch.equal(live[name], tensor), name
    trainer.train_until_idle()
    assert trainer.optimizer.version == 3
    assert trainer.stats.trained_entries == {("cpt", "reuse"): 1, ("cpt", "recompute"): 1}


def test_a_job_abandoned_in_its_backward_retrains_the_half_consumed_entry_by_recomputation():
    """Dropping a job (a rollback, a label deleted while it trains) in the middle of an
    entry's backward: that entry's recording is partly freed, so it is recomputed, not
    back-propagated a second time (which failed the job and dropped both labels)."""
    training = make_training(TrainConfig(mode="dpo", lora_rank=4))
    for request_id in ("first", "second"):
        serve(training, request_id)
        label(training, request_id)
    run_into_a_backward(training)
    dropped = training.trainer.abandon_job()
    training.train_until_idle()
    assert training.stats.failed_jobs == 0, "a half-consumed recording was back-propagated again"
    assert dropped is True
    trained = training.stats.copy().trained_entries
    assert sum(trained.values()) == 2 and trained.get(("dpo", "recompute"), 0) >= 1, trained
    training.close()


def test_a_dropped_job_of_stale_recordings_loses_none_of_its_other_labels():
    """Recordings one version old train on the stashed path. Dropping their job
    mid-backward requeues them as label entries, recomputed: under `stale_policy = "drop"`
    the ones whose recordings the job spent are not taken for stale and dropped."""
    training = make_training(TrainConfig(mode="dpo", lora_rank=4, max_staleness=1, stale_policy="drop"))
    for request_id in ("earlier", "first", "second"):
        serve(training, request_id)
    label(training, "earlier")
    training.train_until_idle()
    assert training.optimizer.version == 1
    for request_id in ("first", "second"):  # recorded under version 0: one version stale
        label(training, request_id)
    run_into_a_backward(training)
    assert training.trainer.abandon_job()
    training.train_until_idle()
    trained = training.stats.copy()
    assert sum(trained.trained_entries.values()) == 3 and trained.stale_dropped == 0, trained
    training.close()


def test_a_rollback_refused_as_incompatible_leaves_the_job_in_progress():
    trainer = make_trainer()
    serve(trainer, "a")
    trainer.train_until_idle()
    snapshot = trainer.lifecycle.snapshot()
    wrong_rank = dataclasses.replace(snapshot, peft_config=dataclasses.replace(snapshot.peft_config, r=2))
    serve(trainer, "b", prompt="Hello, how are you today? I am fine.")
    for _ in range(3):
        assert trainer.run_slice()
    with pytest.raises(AdapterMismatchError):
        trainer.rollback(wrong_rank)
    assert trainer.trainer.in_job() and trainer.cache.get("b").state.value == "training"
    trainer.train_until_idle()  # the job finishes where it was
    assert trainer.optimizer.version == 2 and trainer.stats.trained_entries == {("cpt", "reuse"): 2}
