"""What the scripts here share: DPO training on a directory as a server builds it (versions
saved there, and the ledger), as tests/test_ledger.py builds it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.conftest import make_training  # noqa: E402
from tests.test_ledger import DPO  # noqa: E402
from trainer.adapter_store import AdapterCheckpointer, AdapterStore  # noqa: E402
from trainer.ledger import Ledger  # noqa: E402
from trainer.ledger_db import LEDGER_FILE  # noqa: E402


def training_on(root: Path, save_every: int = 10):
    ledger = Ledger(root / LEDGER_FILE)
    return make_training(DPO, checkpointer=AdapterCheckpointer(AdapterStore(root), save_every, ledger), ledger=ledger)


def first_save_fails(training) -> list[int]:
    """The next save of `training`'s checkpointer fails (a full disk); the later ones save.
    The versions it was asked to save, in order."""
    store, asked = training.lifecycle.checkpointer.store, []
    plain = store.save

    def save(snapshot):
        asked.append(snapshot.version)
        if len(asked) == 1:
            raise OSError("disk full")
        return plain(snapshot)

    store.save = save
    return asked
