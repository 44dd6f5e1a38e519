"""Real system (tiny CPU model, as tests/test_ledger.py builds it): label "r" trained into 1,
quarantined by a rollback to 0 (as 2), released; on restart a rollback to 1 (which holds r)
whose save fails. Until a later save carries it, the ledger still says r waits ('released',
fate NULL), the cache keeps it queued, and no rollback save is in flight any more
(`rollback_saving()` is False), so the next training job trains r again: v1's weights hold it twice."""
import sys, tempfile
from pathlib import Path
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
sys.dont_write_bytecode = True
from common import first_save_fails, training_on as _training
from tests.test_ledger import crash, released_after_a_rollback, rows_by_id
from trainer.ledger_db import LEDGER_FILE

root = Path(tempfile.mkdtemp())
released_after_a_rollback(root)
last = _training(root, save_every=1)
saves = first_save_fails(last)
v = last.rollback(last.lifecycle.load_saved(1))
print("rollback as", v, "saves", saves, "rollback_saving:", last.lifecycle.rollback_saving(),
      "r queued:", last.cache.get("r") is not None)
last.train_until_idle()
last.ledger.flush()
row = rows_by_id(root / LEDGER_FILE)["r"]
print("trained_entries:", last.stats.copy().trained_entries, "optimizer version:", last.optimizer.version)
print("ledger r:", row.fate, row.fate_version, row.fate_reason)
print("DEFECT: r trained again while v%d (a copy of v1) holds it" % v
      if last.stats.copy().trained_entries else "held: not trained again")
last.close()
