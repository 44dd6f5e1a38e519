"""Real system (tiny CPU model, tests/test_ledger.py's helpers), ONE failed save: r trained
into 1 (saved); a rollback to 1 (as 2) whose save fails; a rollback to 0 (as 3) that saves,
carrying the first (snapshot.state['rollbacks'] = [[1, 2]], rolled_back_to = 0): r quarantined.
Stopped, `feedback release` releases r; the restart re-applies (1, 2) then (0, 3) and r is
quarantined again: it does not train."""
import sys, tempfile
from pathlib import Path
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
sys.dont_write_bytecode = True
from common import first_save_fails, training_on as _training
from tests.test_ledger import serve_and_label, rows_by_id
from trainer.ledger_db import LEDGER_FILE, release_quarantined

root = Path(tempfile.mkdtemp())
first = _training(root, save_every=1)
serve_and_label(first, ("r",), train_each=True)
assert first.optimizer.version == 1
first.lifecycle.checkpointer.wait()
store = first.lifecycle.checkpointer.store
plain = store.save
first_save_fails(first)
print("rollbacks as", first.rollback(first.lifecycle.load_saved(1)), first.rollback(first.lifecycle.load_saved(0)))
store.save = plain
first.close()  # the shutdown's save carries both
row = rows_by_id(root / LEDGER_FILE)["r"]
print("after shutdown:", row.fate, row.fate_version, row.fate_reason)
print("released:", release_quarantined(root / LEDGER_FILE))
second = _training(root, save_every=1)
second.ledger.flush()
row = rows_by_id(root / LEDGER_FILE)["r"]
print("after restart:", second.optimizer.version, row.fate, row.fate_version, row.fate_reason,
      "queued:", second.cache.get("r") is not None)
second.train_until_idle()
print("trained_entries:", second.stats.copy().trained_entries)
print("DEFECT: release undone" if row.fate == "quarantined" else "ok")
second.close()
