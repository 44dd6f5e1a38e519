"""Real system (tiny CPU model, tests/test_ledger.py's helpers): r trained into 1 (saved); two
rollbacks whose saves fail (to 1 as 2, to 0 as 3); a clean shutdown saves version 3 carrying
both, and their fates quarantine r; `feedback release` releases r; the restart re-applies the
carried rollbacks and r is quarantined again: it does not train."""
import sys, tempfile
from pathlib import Path
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
sys.dont_write_bytecode = True
from tests.test_ledger import DPO, serve_and_label, rows_by_id
from tests.conftest import make_training
from trainer.adapter_store import AdapterCheckpointer, AdapterStore
from trainer.ledger import Ledger
from trainer.ledger_db import LEDGER_FILE


def _training(root, save_every: int = 10):  # (tests/test_ledger.py's)
    ledger = Ledger(root / LEDGER_FILE)
    return make_training(DPO, checkpointer=AdapterCheckpointer(AdapterStore(root), save_every, ledger), ledger=ledger)


from trainer.ledger_db import LEDGER_FILE, release_quarantined

root = Path(tempfile.mkdtemp())
first = _training(root, save_every=1)
serve_and_label(first, ("r",), train_each=True)
assert first.optimizer.version == 1
first.lifecycle.checkpointer.wait()
store = first.lifecycle.checkpointer.store
plain = store.save
def failing(snapshot):
    raise OSError("disk full")
store.save = failing
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
