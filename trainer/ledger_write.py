"""One write queued for the feedback ledger's writer thread (trainer/ledger.py): what it
does inside the writer's transaction, and whom it tells when it lands or fails; and the
backlog of queued writes that failed, kept in order to be tried again."""

from __future__ import annotations

import concurrent.futures
import logging
import sqlite3
import time
from collections import Counter

logger = logging.getLogger(__name__)

# queued writes (requests' rows, fates) kept for retry while the ledger cannot be written
MAX_RETRY_BACKLOG = 100_000
# while writes fail, one line of the log per this many seconds
LOG_EVERY_S = 60.0


def is_full(exc: Exception) -> bool:
    """The database is at its size bound (or the disk full): retention can make room."""
    return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL


class QueuedWrite:
    """`apply(conn)` inside the writer's transaction; `done` is set for writes whose caller
    waits (labels: one that fails is not retried, its caller hears it); `owed`: a fate or a
    lineage, which a version saved after it depends on (`flush(strict=True)` waits for
    those alone); `request_id`: the request whose rows it writes, where it writes one's
    (`with_prompts`: and those of its prompts, `<request_id>-<i>`)."""

    def __init__(self, apply, done: concurrent.futures.Future | None = None, committed=None, owed: bool = False,
                 tried=None, request_id: str | None = None, with_prompts: bool = False):
        self.apply = apply
        self.done = done
        self.owed = owed
        self.request_id = request_id
        self.with_prompts = with_prompts
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
    tried again before the next ones. A request's writes land in the order they were queued:
    one queued after a write of its request that waits here waits behind it (a finished
    request's choices or its fate, written before its row, would update no row and be lost)."""

    def __init__(self):
        self.writes: list[QueuedWrite] = []
        self._requests: Counter = Counter()
        # owed writes given up (past MAX_RETRY_BACKLOG): no version may be saved after them
        self.given_up_owed = 0
        self._logged = float("-inf")

    def __len__(self) -> int:
        return len(self.writes)

    def take(self) -> list[QueuedWrite]:
        """Every write kept, in order; the backlog is empty after."""
        writes, self.writes = self.writes, []
        self._requests.clear()
        return writes

    def keep(self, write: QueuedWrite, exc: Exception | None = None) -> None:
        """Keeps `write` for the next try (`exc`: why it failed; None: it was not tried, as it
        waits behind an earlier write of its request)."""
        self.writes.append(write)
        if write.request_id is not None:
            self._requests[write.request_id] += 1
        if exc is not None and time.monotonic() - self._logged >= LOG_EVERY_S:
            self._logged = time.monotonic()
            logger.warning("feedback ledger writes fail (%s): %d wait to be retried with the next writes", exc,
                           len(self.writes))
        if len(self.writes) > MAX_RETRY_BACKLOG:
            oldest = self.writes.pop(0)
            self.given_up_owed += oldest.owed  # strict flushes fail: a restart trains them again
            if oldest.request_id is not None:
                self._requests[oldest.request_id] -= 1
            logger.error("feedback ledger: more than %d writes wait to be retried; the oldest is given up",
                         MAX_RETRY_BACKLOG)

    def holds_back(self, write: QueuedWrite) -> bool:
        """Whether an earlier write of `write`'s request (or, for a deletion, of one of its
        prompts) waits here, so that `write` may not land before it."""
        request_id = write.request_id
        if request_id is None or not self._requests:
            return False
        if self._requests[request_id] > 0:
            return True
        return write.with_prompts and any(n > 0 and key.startswith(f"{request_id}-")
                                          for key, n in self._requests.items())

    def owed_waiting(self) -> int:
        """Fates and lineages left for their retry, or given up."""
        return sum(w.owed for w in self.writes) + self.given_up_owed
