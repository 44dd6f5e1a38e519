"""The highest adapter version number given out, kept where a full disk cannot refuse it.

A restart gives the weights it resumes a number after every number given before, so that
a number never names two adapters. The feedback ledger knows the numbers its rows name,
but on a full disk it writes none, and neither does a save: so the process that saves
versions also keeps the highest number given in `DIR/.versions-given`, written over bytes
allocated at start (a full disk does not refuse an overwrite in place, but on a
copy-on-write filesystem, btrfs or ZFS, it may) by a thread of its own, as the ledger's
rows are written on theirs: the device thread never waits for the disk, nor a number for
a save.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
from pathlib import Path

from trainer.log_throttle import Throttle

logger = logging.getLogger(__name__)

MARK_FILE = ".versions-given"
_WIDTH = 21  # b"%020d\n"


class VersionMark:
    def __init__(self, root: Path):
        self._fd = os.open(root / MARK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        text = os.pread(self._fd, _WIDTH, 0).strip()
        # the highest number given (-1: none; a directory from before it was kept)
        self.given = int(text) if text.isdigit() else -1
        self._failing = Throttle()
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="alchemist-version-mark")
        if os.fstat(self._fd).st_size < _WIDTH:  # the bytes later writes overwrite
            error = self._write(self.given)
            if error is not None:
                logger.warning("cannot allocate %s (%s): the numbers given are known from the feedback ledger alone",
                               MARK_FILE, error)

    def give(self, version: int) -> None:
        """`version` was given to weights (any thread): written on the mark's thread."""
        if version > self.given:
            with contextlib.suppress(RuntimeError):  # (closed: a stop gives no number)
                self._writer.submit(self._given, version)

    def _given(self, version: int) -> None:
        error = self._write(version) if version > self.given else None
        if error is not None and self._failing.due():  # a restart may give it again
            logger.warning("cannot record adapter version %d as given in %s: %s", version, MARK_FILE, error)

    def _write(self, value: int) -> OSError | None:
        try:
            os.pwrite(self._fd, b"%020d\n" % value, 0)
            os.fdatasync(self._fd)
        except OSError as exc:
            return exc
        self.given = value
        return None

    def close(self) -> None:
        """Writes what was given, then closes the file (once)."""
        self._writer.shutdown(wait=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
