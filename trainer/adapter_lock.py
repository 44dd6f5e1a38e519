"""One process at a time writes an adapter directory (trainer/adapter_store.py): two would
number different weights alike and delete each other's saves in progress."""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO

LOCK_FILE = ".lock"


class AdapterDirectoryInUse(ValueError):
    """Another process writes the adapter directory (a configuration error at start)."""


# the adapter directories this process holds, each by one open file for the process's life: a POSIX record
# lock is the process's, and closing any file on it (a second store's, dropped) would release it
_HELD: dict[Path, IO] = {}


def lock_directory(root: Path) -> IO:
    """Holds `root/.lock` for this process: a POSIX record lock, which the process's end
    releases (SIGKILL too), and which the same process may take again (a restart in tests)."""
    key = root.resolve()
    if key in _HELD:
        return _HELD[key]
    handle = open(root / LOCK_FILE, "a+")
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise AdapterDirectoryInUse(
            f"another process is training into the adapter directory {root} (it holds {root / LOCK_FILE}): two "
            "servers would overwrite each other's versions; give each its own --adapter-dir, or serve this one's "
            "versions with --train-mode off") from None
    _HELD[key] = handle
    return handle
