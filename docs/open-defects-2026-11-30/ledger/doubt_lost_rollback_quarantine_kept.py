"""Doubtful (new with fates written at once for a rollback whose save failed): r trains into 1
(unsaved); a rollback to 0 (as 2) whose save fails quarantines r at once (fate_version 1). A crash
loses 1 and 2; the restart resumes 0 as 3. r's training was lost with the versions, yet it stays
`quarantined` (restore(resumed=True) leaves quarantined rows alone; replay.py reopens only
fate='trained' AND fate_version > saved), needing `feedback release`; before, the lost rollback's
fates were never written and replay reopened r (trains again). ledger_lineage's docstring ("what
trained into the lost versions is opened again") can be read either way; the operator did undo it.
Second sequence: released then trained again, a crash reopens it as `released` naming lost v1
(doubt_reopen_lost_training_released.py, now also reached through an unsaved rollback)."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.ledger_model import replay  # noqa: E402
print(replay([("serve", "r", True), ("step", ["r"]), ("rollback_unsaved", 0), ("restart", True, None)], verbose=True))
print(replay([("serve", "r", True), ("step", ["r"]), ("rollback_unsaved", 0), ("restart", True, "all"), ("save",),
              ("step", ["r"]), ("restart", True, None)], verbose=True))
