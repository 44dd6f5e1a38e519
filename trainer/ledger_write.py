"""One write queued for the feedback ledger's writer thread (trainer/ledger.py): what it
does inside the writer's transaction, and whom it tells when it lands or fails; and the
backlog of queued writes that failed, kept in order to be tried again."""

from __future__ import annotations

import concurrent.futures
import logging
import sqlite3
import threading
from collections import Counter

from trainer.log_throttle import Throttle

logger = logging.getLogger(__name__)

# queued writes (requests' rows, fates) kept for retry while the ledger cannot be written
MAX_RETRY_BACKLOG = 100_000


def is_full(exc: Exception) -> bool:
    """The database is at its size bound (or the disk full): retention can make room."""
    return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL


class QueuedWrite:
    """`apply(conn)` inside the writer's transaction; `done` is set for writes whose caller
    waits (labels: one that fails is not retried, its caller hears it); `owed`: a fate or a
    lineage, which a version saved after it depends on (`flush(strict=True)` waits for
    those alone); `request_id`: the request whose rows it writes, where it writes one's
    (`with_prompts`: and those of its prompts, `<request_id>-<i>`: a deletion)."""

    def __init__(self, apply, done: concurrent.futures.Future | None = None, committed=None, owed: bool = False,
                 tried=None, request_id: str | None = None, with_prompts: bool = False, inserts_row: bool = False):
        self.apply = apply
        self.done = done
        self.owed = owed
        self.request_id = request_id
        self.with_prompts = with_prompts
        # it writes its request's row (the first of the request's writes)
        self.inserts_row = inserts_row
        # (set while it waits in a RetryBacklog) whether a save waits for it
        self.anchored = False
        # called once its transaction has committed (not when it is tried again after a failure)
        self.committed = committed
        # called each time it has been tried, committed or not (what waits for it waits no longer)
        self.tried = tried

    def landed(self) -> None:
        """Its transaction committed."""
        if self.committed is not None:
            self.committed()
        self.was_tried()
        if self.done is not None:
            self.done.set_result(None)

    def was_tried(self) -> None:
        """It was tried (landed or not): what waits on `tried` waits no longer."""
        if self.tried is not None:
            self.tried()


class RetryBacklog:
    """Queued writes that failed (no room, a lock, a read-only disk), in their order, to be
    tried again before the next ones. What must land after one of them waits behind it: a
    request's every write behind its row's (a finished request's choices or its fate, run
    before the row they update, would update nothing and be lost), its fate behind its
    earlier fate, a deletion behind the rows of its request and prompts (else they would
    come back), and a lineage (a rollback, a quarantine) behind the fates queued before it."""

    def __init__(self):
        self.writes: list[QueuedWrite] = []
        self._rows: Counter = Counter()  # request id -> its row's writes waiting here
        self._fates: Counter = Counter()  # request id -> its owed writes (fates) waiting here
        # owed writes waiting whose request's row is written (or that name no request): no version may be
        # saved before they land; one behind its row's write is no save's concern (no label can be on a row
        # the ledger does not hold, and a restart gives the row its fate)
        self._anchored_owed = 0
        # owed writes given up (past MAX_RETRY_BACKLOG): no version may be saved after them
        self.given_up_owed = 0
        self._failing = Throttle()

    def __len__(self) -> int:
        return len(self.writes)

    def take(self) -> list[QueuedWrite]:
        """Every write kept, in order; the backlog is empty after."""
        writes, self.writes = self.writes, []
        self._rows.clear()
        self._fates.clear()
        self._anchored_owed = 0
        return writes

    def keep(self, write: QueuedWrite, exc: Exception | None = None) -> None:
        """Keeps `write` for the next try (`exc`: why it failed; None: it was not tried, as it
        waits behind an earlier write)."""
        self.writes.append(write)
        self._count(write, 1)
        if exc is not None and self._failing.due():
            logger.warning("feedback ledger writes fail (%s): they wait to be retried with the next writes "
                           "(alchemist:ledger_retry_backlog)", exc)
        if len(self.writes) > MAX_RETRY_BACKLOG:
            oldest = self.writes.pop(0)
            self._count(oldest, -1)
            self.given_up_owed += oldest.owed  # strict flushes fail: a restart trains them again
            logger.error("feedback ledger: more than %d writes wait to be retried; the oldest is given up",
                         MAX_RETRY_BACKLOG)

    def _count(self, write: QueuedWrite, step: int) -> None:
        request_id = write.request_id
        if request_id is not None and write.inserts_row:
            self._rows[request_id] += step
        if write.owed:
            if request_id is not None:
                self._fates[request_id] += step
            if step > 0:
                write.anchored = request_id is None or not self._rows[request_id]
            self._anchored_owed += step * write.anchored

    def holds_back(self, write: QueuedWrite) -> bool:
        """Whether `write` may not land before a write waiting here (the class docstring)."""
        request_id = write.request_id
        if request_id is None:
            return write.owed and self._anchored_owed > 0
        if self._rows[request_id] > 0 or (write.owed and self._fates[request_id] > 0):
            return True
        return write.with_prompts and any(n > 0 and key.startswith(f"{request_id}-") for key, n in self._rows.items())

    def owed_waiting(self) -> int:
        """Fates and lineages a save waits for: those left for their retry (not behind their
        request's row), or given up."""
        return self._anchored_owed + self.given_up_owed


class RefusalCount:
    """The labels and deletions the ledger refused (503), counted into `stats.refused_writes`
    from the writer's thread and the callers' alike, and said in the log once a minute while
    it lasts."""

    def __init__(self, stats):
        self._stats = stats
        self._lock = threading.Lock()
        self._said = Throttle()

    def add(self, why: str) -> None:
        with self._lock:
            self._stats.refused_writes += 1
            refused = self._stats.refused_writes
        if self._said.due():
            logger.warning("%s: labels and deletions get 503 until it can (%d refused so far)", why, refused)
