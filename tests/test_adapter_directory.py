"""The adapter directory as a team shares it: one process trains into it at a time (a
second would number other weights alike and delete the first's saves in progress),
freed by the first's end, even by SIGKILL; and what it saves, others may read as the
umask says (a vLLM or PEFT process under another uid loads the versions)."""

import dataclasses
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.servers import tiny_app
from tests.test_training import label, make_trainer, serve
from trainer import adapter_copies
from trainer.adapter_lock import AdapterDirectoryInUse
from trainer.adapter_store import AdapterCheckpointer, AdapterStore
from trainer.config import AdapterConfig, TrainConfig

HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from trainer.adapter_store import AdapterStore
    store = AdapterStore({root!r})
    print("held", flush=True)
    time.sleep(600)
""")


def test_a_second_process_cannot_train_into_a_directory_another_holds_until_that_one_is_killed(tmp_path):
    root = tmp_path / "adapters"
    repo = str(Path(__file__).resolve().parents[1])
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=repo, root=str(root))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        leftover = root / ".tmp-v00000007-save-in-progress"
        leftover.mkdir()
        with pytest.raises(AdapterDirectoryInUse, match="another process is training into"):
            AdapterStore(root)
        assert leftover.is_dir()  # the holder's save in progress is left alone
        AdapterStore(root, read_only=True).versions()  # reading (a server serving its versions frozen) is fine
    finally:
        holder.kill()
        holder.wait(30)
    AdapterStore(root)  # SIGKILL released it
    assert not leftover.exists()  # and the save it cut short is cleared, as at any start


def test_a_saved_version_is_readable_as_the_umask_says(tmp_path):
    previous = os.umask(0o022)
    try:
        trainer = make_trainer("llama", "dpo")
        serve(trainer, "r0")
        label(trainer, "r0")
        trainer.train_until_idle()
        path = AdapterCheckpointer(AdapterStore(tmp_path), 1).save_async(trainer.lifecycle.snapshot()).result()
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in path.iterdir()} == {0o644}


def test_an_adapter_version_that_would_be_ignored_is_a_configuration_error(tmp_path):
    with pytest.raises(ValueError, match="not given"):
        AdapterConfig(version=3)  # no directory to take it from
    with pytest.raises(ValueError, match="served frozen, with training off"):
        tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=AdapterConfig(dir=str(tmp_path), version=3))


def test_a_directory_gone_from_under_a_running_server_lists_no_version_instead_of_failing(tmp_path):
    store = AdapterStore(tmp_path / "adapters")
    (tmp_path / "adapters" / ".lock").unlink()
    (tmp_path / "adapters").rmdir()  # the volume unmounted
    assert store.versions() == [] and not store.is_saved(0)


def test_copies_of_other_versions_are_pruned_before_the_distinct_versions_they_could_roll_back_to(tmp_path):
    """Five retried rollbacks to version 1 (or five rejections by the eval gate) used to
    push every distinct version, version 0 included, out of `keep`."""
    snapshot = make_trainer("llama", "dpo").lifecycle.snapshot()
    store = AdapterStore(tmp_path, keep=3)
    for version, state in ((0, {}), (1, {}), (2, {"rolled_back_to": 1}), (3, {"copy_of": 1}),
                           (4, {"rolled_back_to": 1}), (5, {"rolled_back_to": 1})):
        store.save(dataclasses.replace(snapshot, version=version, state=state))
    assert [saved.version for saved in store.versions()] == [0, 4, 5]  # version 1's weights: the newest holds them
    for version in (6, 7):
        store.save(dataclasses.replace(snapshot, version=version, state={}))
    assert [saved.version for saved in store.versions()] == [5, 6, 7]  # a copy too many, then the oldest


def test_a_copy_whose_original_is_no_longer_saved_is_kept_as_any_version(tmp_path):
    """Its weights are on disk nowhere else (a review: the old order deleted them)."""
    snapshot = make_trainer("llama", "dpo").lifecycle.snapshot()
    store = AdapterStore(tmp_path, keep=2)
    for version, state in ((0, {}), (5, {}), (6, {"rolled_back_to": 0}), (7, {}), (8, {"copy_of": 3})):
        store.save(dataclasses.replace(snapshot, version=version, state=state))
    assert [saved.version for saved in store.versions()] == [7, 8]
    store = AdapterStore(tmp_path / "b", keep=3)
    for version, state in ((0, {}), (5, {}), (6, {"rolled_back_to": 0}), (7, {})):
        store.save(dataclasses.replace(snapshot, version=version, state=state))
    assert [saved.version for saved in store.versions()] == [0, 5, 7]  # the copy of 0 goes, 0 stays


def test_the_newest_version_holds_its_weights_for_every_copy_of_them(tmp_path):
    """A rollback to version 5 saved as version 21: 21 stays (the newest always does), so
    version 5 is the one that gives way, not version 0 (a review: the original was kept
    beside its newest copy, and a distinct version went instead)."""
    snapshot = make_trainer("llama", "dpo").lifecycle.snapshot()
    store = AdapterStore(tmp_path, keep=5)
    for version, state in ((0, {}), (5, {}), (10, {}), (15, {}), (20, {}), (21, {"weights_of": 5})):
        store.save(dataclasses.replace(snapshot, version=version, state=state))
    assert [saved.version for saved in store.versions()] == [0, 10, 15, 20, 21]
    assert [store.holder_of(v) for v in (5, 10, 21, 3)] == [21, 10, 21, 3]  # (3: none, read as not saved)



def test_a_pruned_copy_is_read_from_what_it_copied_as_the_ledger_remembers_it():
    copied = {0: None, 1: None, 6: 1}  # on disk: 6 holds 1's weights
    ledger = {3: 0, 4: 3, 5: 2, 6: 1, 8: 9, 9: 8}  # 3 copied 0, 4 copied 3; 5 copied 2, gone too; a cycle
    assert [adapter_copies.holder_of(copied, v, ledger) for v in (3, 4, 5, 1, 2, 8, 7)] == [0, 0, 5, 1, 2, 8, 7]
    assert adapter_copies.holder_of(copied, 3) == 3  # (no ledger: read as not saved)


def test_states_that_name_each_other_as_copies_do_not_hang_the_pruning(tmp_path):
    snapshot = make_trainer("llama", "dpo").lifecycle.snapshot()
    store = AdapterStore(tmp_path, keep=2)
    for version, state in ((1, {"weights_of": 2}), (2, {"weights_of": 1}), (3, {})):
        store.save(dataclasses.replace(snapshot, version=version, state=state))
    kept = [saved.version for saved in store.versions()]  # one of the pair (either: they name each other)
    assert len(kept) == 2 and kept[-1] == 3


class _Killed(BaseException):
    """The process ends here (SIGKILL): nothing after it runs."""


def test_a_kill_while_an_old_version_is_pruned_leaves_no_half_deleted_version(tmp_path, monkeypatch):
    """`shutil.rmtree` deletes a file at a time: a kill in its middle used to leave a
    version directory without its weights, listed as saved (and counted against `keep`),
    which a rollback to it, or a server serving it, could not load."""
    import trainer.adapter_store as adapter_store

    snapshot = make_trainer("llama", "dpo").lifecycle.snapshot()
    store = AdapterStore(tmp_path, keep=2)
    for version in (0, 1):
        store.save(dataclasses.replace(snapshot, version=version))

    def killed_midway(path, ignore_errors=False):
        (Path(path) / adapter_store.WEIGHTS_FILE).unlink()
        raise _Killed

    monkeypatch.setattr(adapter_store.shutil, "rmtree", killed_midway)
    with pytest.raises(_Killed):
        store.save(dataclasses.replace(snapshot, version=2))  # saved, then version 0 pruned: killed in the delete
    monkeypatch.undo()
    restarted = AdapterStore(tmp_path, keep=2)
    assert [saved.version for saved in restarted.versions()] == [1, 2]
    for saved in restarted.versions():
        restarted.load(saved.version)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock") == ["v00000001", "v00000002"]


def test_a_version_directory_missing_a_file_is_no_saved_version_and_is_saved_again(tmp_path):
    snapshot = make_trainer("llama", "dpo").lifecycle.snapshot()
    store = AdapterStore(tmp_path)
    for version in (0, 1):
        store.save(dataclasses.replace(snapshot, version=version))
    (store.path_of(1) / "optimizer.pt").unlink()  # whatever left it so
    assert [saved.version for saved in store.versions()] == [0] and not store.is_saved(1)
    store.save(dataclasses.replace(snapshot, version=1))
    assert [saved.version for saved in store.versions()] == [0, 1]
    store.load(1)
    (store.path_of(0) / "adapter_model.safetensors").unlink()
    restarted = AdapterStore(tmp_path)  # moved aside at start, kept to look at
    assert [saved.version for saved in restarted.versions()] == [1]
    assert [p.name.split(".")[1].split("-")[0] for p in tmp_path.glob("v00000000.*")] == ["incomplete"]
