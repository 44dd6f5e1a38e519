"""The feedback ledger and the adapter's versions on storage that fails them, as an outside
pass left it: a ledger file that is no database, a read-only mount, a full disk at start-up
or at a save. Each is a one-line error naming what failed (no traceback), and a reader reads
what it can. The mounts need root (CI's); without, those tests are skipped."""

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server.cli import main
from tests.conftest import make_training
from tests.test_ledger import serve_and_label
from trainer.adapter_store import AdapterCheckpointer, AdapterStore
from trainer.config import TrainConfig
from trainer.ledger import Ledger
from trainer.ledger_db import LEDGER_FILE, ChoiceRecord, LabelRecord, RequestRecord
from trainer.ledger_file import LedgerOpenError
from trainer.version_mark import MARK_FILE, VersionMark

ROOT = Path(__file__).resolve().parents[1]


def _ledger_with_one_label(root) -> None:
    ledger = Ledger(root / LEDGER_FILE)
    ledger.record_request(RequestRecord("r1", time.time(), 0, "dpo", [1, 2], [{"role": "user", "content": "Hi"}]))
    ledger.record_finished("r1", [ChoiceRecord(0, [3], "a")], False)
    ledger.commit_label("r1", LabelRecord("preference", chosen="a", rejected="b"))
    ledger.close()


@contextlib.contextmanager
def mounted(target, *options: str):
    """`target` mounted with `options` (`mount`'s), unmounted after; skips the test where
    this process may not mount."""
    target.mkdir(exist_ok=True)
    done = subprocess.run(["mount", *options, str(target)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def test_a_ledger_file_that_is_no_database_is_an_error_naming_it(tmp_path, capsys):
    (tmp_path / LEDGER_FILE).write_bytes(b"not a database, but a file of the same name " * 200)
    with pytest.raises(LedgerOpenError, match=f"{LEDGER_FILE} cannot be opened for writing: file is not a database"):
        Ledger(tmp_path / LEDGER_FILE)  # (serve says it as a start-up error: an OSError)
    for command in (["list"], ["release", "r1"], ["export", "--format", "preference"]):
        assert main(["feedback", *command, "--adapter-dir", str(tmp_path)]) == 2
        said = capsys.readouterr().err
        assert said.startswith("alchemist:") and "not a database" in said and "Traceback" not in said, said


def test_a_ledger_on_a_read_only_mount_is_listed_and_exported(tmp_path, capsys):
    """A copy of an adapter directory mounted read-only (a backup, a volume mounted so): SQLite
    could not make the file its log is read through, and `feedback list` ended in a traceback."""
    source = tmp_path / "adapters"
    source.mkdir()
    _ledger_with_one_label(source)  # closed: its log checkpointed and gone
    with mounted(tmp_path / "read-only", "--bind", "-o", "ro", str(source)) as view:
        assert main(["feedback", "list", "--adapter-dir", str(view), "--json"]) == 0
        assert '"id": "r1"' in capsys.readouterr().out
        assert main(["feedback", "export", "--adapter-dir", str(view), "--format", "preference"]) == 0
        assert '"chosen"' in capsys.readouterr().out
        assert main(["feedback", "release", "r1", "--adapter-dir", str(view)]) == 2  # it writes: refused, said
        said = capsys.readouterr().err
        assert "cannot be opened for writing" in said and "Traceback" not in said, said


def test_a_ledger_whose_log_a_read_only_mount_cannot_be_read_through_is_refused_not_read_short(tmp_path, capsys):
    """Left by a kill: commits in the write-ahead log, which a reader that cannot write beside
    it would skip (SQLite's immutable mode): refused, saying to read a copy."""
    source = tmp_path / "adapters"
    source.mkdir()
    script = ("import sys, os, time; from trainer.ledger import Ledger; from trainer.ledger_db import RequestRecord; "
              "l = Ledger(sys.argv[1]); l.record_request(RequestRecord('r1', time.time(), 0, 'dpo', [1])); "
              "l.flush(); os._exit(0)")  # (a small log is checkpointed only by a clean close)
    subprocess.run([sys.executable, "-c", script, str(source / LEDGER_FILE)], check=True, cwd=ROOT)
    (source / f"{LEDGER_FILE}-shm").unlink()
    assert (source / f"{LEDGER_FILE}-wal").stat().st_size > 0
    with mounted(tmp_path / "read-only", "--bind", "-o", "ro", str(source)) as view:
        assert main(["feedback", "list", "--adapter-dir", str(view)]) == 2
        said = capsys.readouterr().err
        assert "read a copy of the directory" in said and "Traceback" not in said, said


def test_a_full_disk_at_start_up_is_an_error_naming_the_ledger(tmp_path):
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=64k", "tmpfs") as small:
        filler = small / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as out:
            out.write(b"\0" * (1 << 20))
        with pytest.raises(LedgerOpenError, match="cannot be opened for writing: database or disk is full"):
            Ledger(small / LEDGER_FILE)


def test_a_save_on_a_full_disk_says_how_much_room_a_version_needs(tmp_path, caplog):
    """torch's writer fails with "unexpected pos" on a full disk: the log says what is free
    and what a version takes, in one line."""
    ledger = Ledger(tmp_path / LEDGER_FILE)
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=4m", "tmpfs") as small:
        checkpointer = AdapterCheckpointer(AdapterStore(small / "adapters"), 1, ledger)
        training = make_training(TrainConfig(mode="dpo", lora_rank=4), checkpointer=checkpointer, ledger=ledger)
        assert checkpointer.last_saved_version == 0
        with contextlib.suppress(OSError), open(small / "filler", "wb") as out:
            out.write(b"\0" * (8 << 20))
        serve_and_label(training, ("r0",), train_each=True)
        checkpointer.wait()
        assert training.optimizer.version == 1 and checkpointer.failed == 1
        said = [r for r in caplog.records if "saving adapter version 1 failed" in r.getMessage()]
        assert len(said) == 1 and "MiB free, this version takes" in said[0].getMessage() and not said[0].exc_info, said
        training.close()


def test_the_version_numbers_given_are_kept_on_a_disk_that_filled_after_start(tmp_path):
    """`DIR/.versions-given` is overwritten in place: a full disk (tmpfs: no copy-on-write)
    does not refuse it, and a directory from before it reads -1 (the ledger's alone)."""
    first = VersionMark(tmp_path)
    assert first.given == -1
    first.close()
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=64k", "tmpfs") as small:
        mark = VersionMark(small)
        with contextlib.suppress(OSError), open(small / "filler", "wb") as out:
            out.write(b"\0" * (1 << 20))
        for version in (1, 7, 3):  # (a lower number is never written over a higher)
            mark.give(version)
        mark.close()
        mark.close()  # (once)
        again = VersionMark(small)
        assert (small / MARK_FILE).read_text() == f"{7:020d}\n" and again.given == 7
        again.close()
