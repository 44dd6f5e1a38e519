"""D1b: the same early write (a non-saving replica's rollback fates, lifecycle.py:286-290),
where the lineage has an earlier rollback: the write gives back `trained` to labels the
restored version holds and the resumed one does not (lost for good: a release does not
touch them), and quarantines a label the resumed version holds (trained twice after a release)."""
import sys, tempfile, pathlib
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from tests.conftest import make_training
from tests.test_training import label, serve
from tests.test_ledger import rows_by_id
from trainer.adapter_store import AdapterCheckpointer, AdapterStore
from trainer.config import TrainConfig
from trainer.ledger import Ledger
from trainer.ledger_db import LEDGER_FILE

DPO = TrainConfig(mode="dpo", lora_rank=4)
root = pathlib.Path(tempfile.mkdtemp())
def rank0():
    ledger = Ledger(root / LEDGER_FILE)
    return make_training(DPO, checkpointer=AdapterCheckpointer(AdapterStore(root), 1, ledger), ledger=ledger)
fates = lambda: {k[-1]: (v.fate, v.fate_version) for k, v in sorted(rows_by_id(root / LEDGER_FILE).items())}

r0 = rank0()
r1 = make_training(DPO, ledger=Ledger(root / LEDGER_FILE))
for rid in ("chatcmpl-r0-a", "chatcmpl-r0-b"):
    serve(r0, rid); label(r0, rid); r0.train_until_idle()
r0.lifecycle.checkpointer.wait()
r0.lifecycle.rollback(r0.lifecycle.load_saved(0))          # an earlier rollback, saved: version 3 = copy of 0
serve(r0, "chatcmpl-r0-c"); label(r0, "chatcmpl-r0-c"); r0.train_until_idle()   # version 4, saved
r0.lifecycle.checkpointer.wait(); r0.ledger.flush()
print("saved:", [v.version for v in r0.lifecycle.saved_versions()], "fates:", fates())
# the round carrying rank 0's rollback to saved version 2: rank 1 applies it (as version 5) and writes its fates
r1.lifecycle.restore(r0.lifecycle.snapshot(), r0.optimizer.version)
r1.lifecycle.rollback_saved_later(r0.lifecycle.load_saved(2)); r1.ledger.flush()
print("after rank 1 applied it (rank 0's save not yet made):", fates())
for t in (r0, r1):
    t.ledger.flush(); t.ledger.close()
r0.lifecycle.checkpointer.wait()
again = rank0()   # kill -9 before rank 0's save: the restart resumes version 4 (holds c; not a, b)
print("restart: resumed saved", again.lifecycle.restored_from, "as", again.optimizer.version,
      "| to train again:", [e.completion_id for e in again.cache.entries()])
again.ledger.flush()
print("ledger:", fates(), "<- a, b 'trained' but version 4's weights do not hold them; c 'quarantined' but they do")
again.close()
