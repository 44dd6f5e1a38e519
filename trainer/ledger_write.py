"""One write queued for the feedback ledger's writer thread (trainer/ledger.py): what it
does inside the writer's transaction, and whom it tells when it lands or fails."""

from __future__ import annotations

import concurrent.futures
import sqlite3


def is_full(exc: Exception) -> bool:
    """The database is at its size bound (or the disk full): retention can make room."""
    return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL


class QueuedWrite:
    """`apply(conn)` inside the writer's transaction; `done` is set for writes whose caller
    waits (labels: one that fails is not retried, its caller hears it); `owed`: a fate or a
    lineage, which a version saved after it depends on (`flush(strict=True)` waits for
    those alone)."""

    def __init__(self, apply, done: concurrent.futures.Future | None = None, committed=None, owed: bool = False,
                 tried=None):
        self.apply = apply
        self.done = done
        self.owed = owed
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
