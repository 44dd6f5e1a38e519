"""`alchemist feedback list` and `release` on a ledger, as an operator runs them after the
eval gate or a rollback quarantined labels (a review found no way to find their ids but SQL,
and `release` saying nothing of ids it did not release)."""

import json
import time

from server.cli import main
from trainer.ledger import Ledger
from trainer.ledger_db import LEDGER_FILE, LabelRecord, RequestRecord


def _ledger_with_a_rollback(tmp_path) -> None:
    """r1 and r2 trained into versions 1 and 2, then version 1 restored as 3 (r2 quarantined);
    r3 served and not labelled yet."""
    ledger = Ledger(tmp_path / LEDGER_FILE)
    for version in (1, 2, 3):
        ledger.record_request(RequestRecord(f"r{version}", time.time() + version, 0, "dpo", [1, 2]))
    for version in (1, 2):
        ledger.commit_label(f"r{version}", LabelRecord("preference", chosen="a", rejected="b"))
        ledger.record_fate(f"r{version}", "trained", version)
    ledger.rolled_back(1, 3)
    ledger.close()


def test_list_finds_the_quarantined_labels_and_release_says_which_it_did_not_release(tmp_path, capsys):
    _ledger_with_a_rollback(tmp_path)
    assert main(["feedback", "list", "--adapter-dir", str(tmp_path), "--fate", "quarantined", "--json"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["id"], r["label"], r["label_source"], r["fate"], r["fate_version"]) for r in listed] == [
        ("r2", "preference", "api", "quarantined", 2)]
    assert "rolled back to version 1" in listed[0]["fate_reason"]

    assert main(["feedback", "release", "--adapter-dir", str(tmp_path), "r2", "r1", "nope"]) == 1
    said = capsys.readouterr().err
    assert "released 1 quarantined labels" in said
    assert "r1: not quarantined: trained v1" in said and "nope: not in the ledger" in said

    assert main(["feedback", "release", "--adapter-dir", str(tmp_path), "r2"]) == 0  # again: done already
    assert "r2: released already" in capsys.readouterr().err
    assert main(["feedback", "list", "--adapter-dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["id", "served_at", "method", "label", "trained", "by", "fate"]
    assert [line.split()[0] for line in table[1:]] == ["r1", "r2", "r3"]
    assert table[2].endswith("waiting (released)") and table[3].split()[3:] == ["-", "-", "waiting"]
    assert main(["feedback", "list", "--adapter-dir", str(tmp_path), "--fate", "waiting", "--labelled", "--json"]) == 0
    assert [json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()] == ["r2"]


def test_list_says_which_trained_labels_no_saved_version_holds_yet(tmp_path, capsys):
    """After a kill, `list` showed labels "trained v13" where only version 12 was on disk (an
    outside pass): the restart trains them again. They say "not saved yet" (JSON: `unsaved`).
    And how each trained (an outside pass: only SQLite said)."""
    ledger = Ledger(tmp_path / LEDGER_FILE)
    ledger.resumed(12, 12)  # the process that saves versions: version 12 is on disk
    for request_id, version, path in (("in-12", 12, "stashed"), ("in-13", 13, "recompute")):
        ledger.record_request(RequestRecord(request_id, time.time(), 11, "dpo", [1, 2]))
        ledger.commit_label(request_id, LabelRecord("preference", chosen="a", rejected="b"))
        ledger.record_fate(request_id, "trained", version, path)
    ledger.close()
    assert main(["feedback", "list", "--adapter-dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].endswith("trained v12") and table[2].endswith("trained v13 (not saved yet)")
    assert table[1].split()[4] == "stashed" and table[2].split()[4] == "recompute"
    assert main(["feedback", "list", "--adapter-dir", str(tmp_path), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["unsaved"], row["fate_path"]) for row in rows] == [(False, "stashed"), (True, "recompute")]
