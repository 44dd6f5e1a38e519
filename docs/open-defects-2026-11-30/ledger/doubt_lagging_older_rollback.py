"""Doubtful (root cause of the release defect): restore(N, V) is not bounded by later copies. An
older rollback's fates applied after a newer one's (a lagging replica's write on a shared node
ledger; a restart's re-applied list) give `trained` to labels the current weights do not hold."""
import sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
sys.dont_write_bytecode = True
from trainer.ledger import Ledger
from trainer.ledger_db import LEDGER_FILE, LabelRecord, RequestRecord, read_ledger
path = Path(tempfile.mkdtemp()) / LEDGER_FILE
ledger = Ledger(path)
ledger.record_request(RequestRecord("r", time.time(), 0, "dpo", [1, 2]))
ledger.commit_label("r", LabelRecord("preference", chosen="a", rejected="b"))
ledger.record_fate("r", "trained", 1)
ledger.rolled_back(1, 2)
ledger.rolled_back(0, 3)        # serving weights: v3 = v0's; r quarantined
ledger.rolled_back(1, 2)        # the older rollback's fates once more
ledger.flush()
row = read_ledger(path)[0]
print("current weights v3 (= v0) hold nothing; ledger says:", row.fate, row.fate_version)
ledger.close()
