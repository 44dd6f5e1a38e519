"""Real system (tiny CPU model, as tests/test_ledger.py builds it): v1 trained and saved; a
rollback to 0 answers as version 2 but its save fails; nothing is served or trained at 2
before a kill. The restart's known_version (the ledger's highest_version) is 1, so it resumes
v1 under its own number and the next step is numbered 2 again: "a number never names two
adapters, in /v1/models or in the ledger" (README, 'Adapter versions')."""
import sys, tempfile
from pathlib import Path
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
sys.dont_write_bytecode = True
from tests.test_ledger import DPO, crash, serve_and_label
from tests.conftest import make_training
from trainer.adapter_store import AdapterCheckpointer, AdapterStore
from trainer.ledger import Ledger
from trainer.ledger_db import LEDGER_FILE


def _training(root, save_every: int = 10):  # (tests/test_ledger.py's)
    ledger = Ledger(root / LEDGER_FILE)
    return make_training(DPO, checkpointer=AdapterCheckpointer(AdapterStore(root), save_every, ledger), ledger=ledger)


from trainer import ledger_lineage
from trainer.ledger_db import LEDGER_FILE

root = Path(tempfile.mkdtemp())
first = _training(root, save_every=1)
serve_and_label(first, ("a",), train_each=True)
assert first.optimizer.version == 1
first.lifecycle.checkpointer.wait()
store = first.lifecycle.checkpointer.store
def failing(snapshot):
    raise OSError("disk full")
store.save = failing
rolled = first.rollback(first.lifecycle.load_saved(0))
print("rollback answered as version", rolled)
crash(first)
print("ledger highest_version after the crash:", ledger_lineage.highest_version(root / LEDGER_FILE))
second = _training(root, save_every=1)
print("restart resumed as version", second.optimizer.version, "restored_from", second.lifecycle.restored_from)
serve_and_label(second, ("b",), train_each=True)
print("next step's version:", second.optimizer.version)
print("DEFECT: version %d names two adapters (the rollback's copy of v0, and v1 + b)" % rolled
      if second.optimizer.version <= rolled else "ok")
second.close()
