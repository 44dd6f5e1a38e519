"""The highest adapter version number given out, kept where a full disk cannot refuse it.

A restart gives the weights it resumes a number after every number given before, so that
a number never names two adapters. The feedback ledger knows the numbers its rows name,
but on a full disk it writes none, and neither does a save: so the process that saves
versions also keeps the highest number given in `DIR/.versions-given`, written over bytes
allocated at start (a full disk does not refuse an overwrite in place) on the saves'
writer thread, as the ledger's rows are written on its own: the device thread never waits
for the disk.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

MARK_FILE = ".versions-given"
_WIDTH = 21  # b"%020d\n"


class VersionMark:
    def __init__(self, root: Path):
        self._fd = os.open(root / MARK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        text = os.pread(self._fd, _WIDTH, 0).strip()
        # the highest number given (-1: none; a directory from before it was kept)
        self.given = int(text) if text.isdigit() else -1
        if os.fstat(self._fd).st_size < _WIDTH:
            self._write(self.given)  # the bytes later writes overwrite

    def give(self, version: int) -> None:
        """`version` was given to weights."""
        if version > self.given:
            self._write(version)

    def _write(self, value: int) -> None:
        try:
            os.pwrite(self._fd, b"%020d\n" % value, 0)
            os.fdatasync(self._fd)
        except OSError as exc:  # a restart may then give this number again
            logger.warning("cannot record adapter version %d as given in %s: %s", value, MARK_FILE, exc)
            return
        self.given = value

    def close(self) -> None:
        os.close(self._fd)
