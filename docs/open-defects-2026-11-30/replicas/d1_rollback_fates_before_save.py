"""D1: a replica that saves no version (rank>=1, same node => same ledger file) writes a
rollback's quarantine into the shared ledger when it *applies* the rollback, before rank 0
saved it (rank 0's own write waits for the save). A kill -9 in that window: the restart
resumes the last saved version S (after the restored one), whose weights hold labels the
ledger now says are quarantined; `feedback release` then trains them a second time."""
import sys, tempfile, pathlib
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from tests.conftest import make_training
from tests.test_training import label, serve
from tests.test_ledger import rows_by_id
from trainer.adapter_store import AdapterCheckpointer, AdapterStore
from trainer.config import TrainConfig
from trainer.ledger import Ledger
from trainer.ledger_db import LEDGER_FILE, release_quarantined
from trainer.replicated import weights_digest

DPO = TrainConfig(mode="dpo", lora_rank=4)
root = pathlib.Path(tempfile.mkdtemp())

def rank0():
    ledger = Ledger(root / LEDGER_FILE)
    return make_training(DPO, checkpointer=AdapterCheckpointer(AdapterStore(root), 1, ledger), ledger=ledger)

r0 = rank0()
# rank 1: same node, same ledger file, no checkpointer (built at start, as the group's replicas are)
r1 = make_training(DPO, ledger=Ledger(root / LEDGER_FILE))
for rid in ("chatcmpl-r0-a", "chatcmpl-r0-b"):
    serve(r0, rid); label(r0, rid); r0.train_until_idle()
r0.lifecycle.checkpointer.wait(); r0.ledger.flush()
print("rank0 version", r0.optimizer.version, "saved", [v.version for v in r0.lifecycle.saved_versions()])
digest_v2 = weights_digest(r0.optimizer.params)

# rank 1 at the round that carries rank 0's rollback to saved version 0
r1.lifecycle.restore(r0.lifecycle.snapshot(), r0.optimizer.version)  # (adopted / in lockstep)
v0 = r0.lifecycle.load_saved(0)
version, saving = r1.lifecycle.rollback_saved_later(v0)
r1.ledger.flush()
print("rank1 applied the rollback as version", version, "saving future:", saving)
print("ledger now (before rank 0 saved anything):", {k: (v.fate, v.fate_version) for k, v in rows_by_id(root / LEDGER_FILE).items()})

# kill -9 of the group before rank 0's save of the rollback (it waits a round or two for every replica's watermark)
for t in (r0, r1):
    t.ledger.flush(); t.ledger.close()
r0.lifecycle.checkpointer.wait()

again = rank0()
print("restart: restored_from", again.lifecycle.restored_from, "as version", again.optimizer.version,
      "weights == v2:", weights_digest(again.optimizer.params) == digest_v2)
again.ledger.flush()
print("ledger after restart:", {k: (v.fate, v.fate_version) for k, v in rows_by_id(root / LEDGER_FILE).items()})
print("labels queued to train again:", [e.completion_id for e in again.cache.entries()])
again.ledger.close()
print("operator runs `alchemist feedback release`:", release_quarantined(root / LEDGER_FILE))
third = rank0()
print("next start queues to train:", [e.completion_id for e in third.cache.entries()],
      "on weights restored from", third.lifecycle.restored_from, "(which already hold them)")
third.train_until_idle(); third.ledger.flush()
print("trained_entries:", third.stats.copy().trained_entries)
third.close()
