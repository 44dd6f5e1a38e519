"""Model-based driver (prop.py), same root cause as the undone release: rollback to 0 (as 1); r0
trains into 2 (saved); a rollback to 1 (as 3) whose save fails; a rollback to 2 (as 4), saved,
carrying it: v4 = v2's weights hold r0 (trained, v2). DELETE r0's label: it stays `trained` (its
effect stays in the weights). A crash: the restart re-applies (1, 3) then (2, 4); (1, 3) drops
r0 for good (deleted, not in v1's lineage), and (2, 4) cannot give it back: the ledger says
`dropped` while the serving weights v4 hold it (a later DELETE of the request answers
trained_into null)."""
import sys
from prop import replay
ops = [('serve', 'r0', True), ('rollback', 0), ('step', ['r0']), ('save',), ('rollback_unsaved', 1),
       ('rollback', 2), ('delete', 'r0'), ('restart', True, None)]
print(replay(ops, verbose=True))
