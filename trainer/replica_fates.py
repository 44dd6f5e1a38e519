"""Among data-parallel replicas, a version is saved only once every replica's ledger holds
the fates of the labels trained into it.

Each replica writes its own labels' fates (`trained` into version v) into its node's ledger,
on the ledger's writer thread, after it applied the round's step. Rank 0 alone saves
versions. A restart resumes from the newest saved version and trains again every label
the ledger does not hold as trained into it: had rank 0 saved v while another replica's
fates for v were still queued, a `kill -9` of that replica would have its labels trained
into v and trained again after the restart — twice in the weights.

So every replica reports, at each round, the version through which its fates are
committed (`FateWatermarks.written`, from the ledger's commit of a marker queued after
them), the rounds take the smallest (`heard`), and rank 0's checkpointer waits for it
before it writes a version (`ReplicatedSaveJournal.before_save`, on the checkpointer's
thread: serving never waits). Once the rounds failed (a replica died, hangs, or leaves
the group), what was not confirmed is not saved: the restart resumes from the last version
confirmed, and the labels trained after it train again, once. At a shutdown the replicas
agreed on, each applies the last rounds' steps after the last round, so their fates get
a last word (`ReplicaSync.last_word`): every replica's watermark once more, before rank 0
saves its final version.

A rollback's save waits for every replica's fates of the versions it undid: a restart that
resumes from it applies its fates again on every node (`AdapterLifecycle.resume`,
`adopted`), quarantining what those versions trained, which it can only do for the labels
whose fates are on disk — one a kill lost would train again. Rank 0's device thread does
not wait for that save (`AdapterLifecycle.rollback_saved_later`).
"""

from __future__ import annotations

import threading
import time

from trainer.adapter_store import AdapterSnapshot, SaveJournal, SaveRefused


class FatesUnconfirmed(SaveRefused):
    """A version's fates are not known to be committed on every replica: it is not saved."""


class FateWatermarks:
    """This replica's version through which its ledger fates are committed, and every
    replica's (the smallest the rounds heard)."""

    def __init__(self, version: int):
        self.mine = version
        self.everywhere = version
        # no round will be heard again: the rounds ended, or `failed` (a replica died, hangs or left)
        self.final = False
        self.failed = False
        self._changed = threading.Condition()

    def written(self, version: int) -> None:
        """This replica's fates through `version` are committed (the ledger's writer thread)."""
        with self._changed:
            self.mine = max(self.mine, version)

    def heard(self, everywhere: int) -> None:
        """The smallest watermark among the replicas, as a round heard it (the sync thread)."""
        with self._changed:
            if everywhere > self.everywhere:
                self.everywhere = everywhere
                self._changed.notify_all()

    def settle(self, failed: bool = False) -> None:
        """Nothing more will be heard; `failed`: because a round failed."""
        with self._changed:
            self.final = True
            self.failed = self.failed or failed
            self._changed.notify_all()

    def wait(self, version: int, timeout_s: float) -> None:
        """Returns once every replica's fates through `version` are committed; FatesUnconfirmed
        once nothing more can be heard, or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.everywhere < version:
                if self.final:
                    raise FatesUnconfirmed(f"the replicas' rounds {'failed' if self.failed else 'ended'} with fates "
                                           f"confirmed through version {self.everywhere}: version {version} is not "
                                           "saved, and a restart trains the labels after that version again")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FatesUnconfirmed(f"the replicas' fates through version {version} were not confirmed "
                                           f"within {timeout_s:g} s (through {self.everywhere})")
                self._changed.wait(left)


class ReplicatedSaveJournal:
    """Rank 0's checkpointer journal among replicas: before a version is written, every
    replica's fates for it are committed (`FateWatermarks.wait`), then rank 0's own ledger
    is flushed as a single server's is."""

    def __init__(self, watermarks: FateWatermarks, ledger: SaveJournal | None, timeout_s: float):
        self.watermarks = watermarks
        self.ledger = ledger
        self.timeout_s = timeout_s

    def before_save(self, snapshot: AdapterSnapshot) -> None:
        # a rollback's own fates are applied again on every node by a restart that resumes from
        # it (`resume`, `adopted`): those of the versions it undid must be there to be moved
        through = snapshot.version - 1 if "rolled_back_to" in snapshot.state else snapshot.version
        self.watermarks.wait(through, self.timeout_s)
        if self.ledger is not None:
            self.ledger.before_save(snapshot)

    def saved(self, version: int) -> None:
        if self.ledger is not None:
            self.ledger.saved(version)

    def resumed(self, saved: int, version: int) -> None:
        if self.ledger is not None:
            self.ledger.resumed(saved, version)
