"""CPU seconds spent by one thread of this process (Linux: /proc/self/task/TID/schedstat,
in nanoseconds, or where the kernel lacks it /stat, in clock ticks).

The server has two threads that matter for a token's cost on the host: the asyncio event
loop (HTTP, JSON, streaming) and the device thread (engine steps, training slices). Their
CPU per output token, set against the step time, says whether the event loop would slow
serving down once steps are fast (`alchemist bench colocate` reports both).
"""

from __future__ import annotations

import os

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu_seconds(native_id: int | None) -> float | None:
    """User plus system CPU seconds of the thread `native_id` (threading.get_native_id()),
    or None where it cannot be read (not Linux, the thread gone, no id yet)."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as schedstat:
            return int(schedstat.read().split()[0]) / 1e9  # time on a CPU, nanoseconds
    except (OSError, IndexError, ValueError):
        pass
    try:
        with open(f"/proc/self/task/{native_id}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # after the command name: state, ppid, pgrp, session, tty_nr, tpgid, flags, minflt,
    # cminflt, majflt, cmajflt, utime, stime (proc(5), fields 3-15)
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_SECOND
