"""Doubtful (deferred by design): while a rollback's save has failed, its fates are not written,
so DELETE /v1/feedback/{id} of a label only the undone versions held answers trained_into = 1
though the serving weights (v2 = v0's) do not hold it ("null for a label in no weights")."""
import sys
import prop
from prop import Runner
from pathlib import Path
import tempfile
r = Runner(Path(tempfile.mkdtemp()))
for op in [("serve", "r", True), ("step", ["r"]), ("rollback_unsaved", 0), ("delete", "r")]:
    r.apply(op)
print(r.doubts)
r.close()
