"""Ledger API only. A label deleted after it trained (into 1) is dropped by a rollback to 0
(as 2); a rollback to 1 (as 3) brings its training back into the serving weights, but the
ledger keeps it `dropped`, so deleting the request itself afterwards
(DELETE /v1/chat/completions/{id}) answers trained_into None: "null for a label in no weights"
(README, 'The feedback ledger'), though v3's weights hold it."""
import sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
sys.dont_write_bytecode = True
from trainer.ledger import Ledger
from trainer.ledger_db import LEDGER_FILE, LabelRecord, RequestRecord, read_ledger

root = Path(tempfile.mkdtemp())
ledger = Ledger(root / LEDGER_FILE)
ledger.resumed(-1, 0)
ledger.record_request(RequestRecord("r", time.time(), 0, "dpo", [1, 2]))
ledger.commit_label("r", LabelRecord("preference", chosen="a", rejected="b"))
ledger.record_fate("r", "trained", 1)
print("delete label:", ledger.delete("r", label_only=True))          # trained_into 1
ledger.rolled_back(0, 2)                                             # undone: dropped (deleted)
ledger.rolled_back(1, 3)                                             # v3 = v1's weights: hold r again
ledger.flush()
row = {r.request.id: r for r in read_ledger(root / LEDGER_FILE)}["r"]
print("after rollback to 1 as 3:", row.fate, row.fate_version, row.fate_reason)
d = ledger.delete("r")                                               # the stored completion itself
print("delete request:", d)
print("DEFECT?" if d.trained_into is None else "ok", "trained_into", d.trained_into, "while v3 holds its training into 1")
ledger.close()
