"""A warning said at most once a period while its cause lasts (a full disk fails every write)."""

from __future__ import annotations

import threading
import time


class Throttle:
    def __init__(self, every_s: float = 60.0):
        self.every_s = every_s
        self._last = float("-inf")
        self._lock = threading.Lock()

    def due(self) -> bool:
        """Whether to say it now (then not again for `every_s`); any thread."""
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s:
                return False
            self._last = now
            return True
