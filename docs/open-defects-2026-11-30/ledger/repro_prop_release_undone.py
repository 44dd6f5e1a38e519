"""Model-based driver (prop.py), minimal sequence: r trained into 1 (saved); a rollback to 1 (as 2)
whose save fails; a rollback to 0 (as 3), saved, carrying it (r quarantined); a clean restart
that releases everything: the restart re-applies (1, 2) and (0, 3), and r is quarantined again."""
import sys
from prop import replay
ops = [("serve", "r", True), ("step", ["r"]), ("save",), ("rollback_unsaved", 1), ("rollback", 0),
       ("restart", False, "all")]
print(replay(ops, verbose=True))
