"""A released label the restored weights hold, while the rollback's save failed (fates deferred):
the ledger still says it waits to train (fate NULL, 'released'), so a step trains it a second time."""
import sys
from prop import replay
ops = [("serve", "r", True), ("step", ["r"]), ("save",),          # r trained into 1, saved
       ("rollback", 0),                                            # 2 = copy of 0: r quarantined
       ("restart", False, "all"),                                  # released; resumes 2 (clean)
       ("rollback_unsaved", 1),                                    # 3 = copy of 1 (holds r), its save failed
       ("step", ["r"])]                                            # the ledger lets r train again
print(replay(ops, verbose=True))
