"""Ledger API, as the lifecycle drives it. r trained into 1 (saved). Two rollbacks whose saves
failed, to 1 (as 2) and to 0 (as 3), are carried by the final save of version 3 at shutdown,
whose fates quarantine r. Stopped, `alchemist feedback release` releases r. The restart re-applies
the carried rollbacks in order (lifecycle.resume: snapshot.state['rollbacks']): restore(1, 2)
gives the released r back `trained` (v1's lineage holds it, though the resumed weights, v3 =
v0's, do not), then restore(0, 3) quarantines it again: the release is silently undone, and r
never trains. ledger_lineage's docstring: "Applying the same rollback twice (a restart after
a kill, each data-parallel replica) changes nothing the second time"."""
import sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
sys.dont_write_bytecode = True
from trainer.ledger import Ledger
from trainer.ledger_db import LEDGER_FILE, LabelRecord, RequestRecord, read_ledger, release_quarantined

root = Path(tempfile.mkdtemp())
path = root / LEDGER_FILE
def fate():
    row = {r.request.id: r for r in read_ledger(path)}["r"]
    return row.fate, row.fate_version, row.fate_reason

ledger = Ledger(path)
ledger.resumed(-1, 0)
ledger.record_request(RequestRecord("r", time.time(), 0, "dpo", [1, 2]))
ledger.commit_label("r", LabelRecord("preference", chosen="a", rejected="b"))
ledger.record_fate("r", "trained", 1)
ledger.saved(1)
# the final save of version 3 carries both unsaved rollbacks; their fates land in order
ledger.rolled_back(1, 2)
ledger.rolled_back(0, 3)
ledger.saved(3)
ledger.close()
print("after shutdown:", fate())                       # quarantined, v1
print("released:", release_quarantined(path))          # ['r']
print("before restart:", fate())                       # (None, 1, 'released')
ledger = Ledger(path)                                   # restart: resume 3 under its own number,
ledger.resumed(3, 3)                                    # then the snapshot's carried rollbacks again
ledger.rolled_back(1, 2)
ledger.flush()
print("  after re-applying (1, 2):", fate())
ledger.rolled_back(0, 3)
ledger.flush()
print("after restart:", fate())
print("DEFECT: the release is undone" if fate()[0] == "quarantined" else "ok")
ledger.close()
