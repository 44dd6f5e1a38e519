"""Minor: r3 trains into candidate 1, the gate rejects it (return v2 unsaved): quarantined (v1). A crash loses
1 and 2 (forget_after(0) clears their earlier_trainings). Released at a clean restart, r3 trains into 4, and
record_fate files the lost v1 in earlier_trainings; a crash loses 4 and reopen makes r3 `released` with
fate_version 1, a version no weights hold (reopen docstring: released again only after an earlier training
that survived). It still trains; harmless while numbers are never reused."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.ledger_model import replay  # noqa: E402
ops = [('serve', 'r3', True), ('step', ['r3']), ('reject', False), ('restart', True, None),
       ('restart', False, 'all'), ('step', ['r3']), ('restart', True, None)]
print(replay(ops, verbose=True))
