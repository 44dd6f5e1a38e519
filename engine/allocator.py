"""Giving freed host memory back to the OS (glibc `malloc_trim`).

Recorded prefills allocate hundreds of MB of activations of every size and free them
when trained on or expired; with several threads, glibc keeps those freed pages in its
heaps, fragmented, and a long-running server's RSS climbs far above what it holds
(`alchemist bench soak`: 3 GB -> 11 GB in three minutes with 1 GB of live activations).
`malloc_trim(0)` returns the free pages; it takes about 15-35 ms for 500 MB here, so the
trainer calls it as one idle slice after enough activation bytes were released. Raising
glibc's mmap threshold to keep freed memory (this module's earlier tuning) made the
growth worse and is gone. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> bool:
    """Returns free heap pages to the OS; False where glibc's malloc_trim is missing."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
