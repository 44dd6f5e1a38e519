"""The heap warmed for a recording by writing a byte per page (`HeapWarmer`, now) against
writing every byte (`memset`, before), on a thread of its own as the server's device thread
warms it: a 410 MB warm heap in 2.6 MB pieces (the sizes of the largest recording under
`bench colocate` on the embedded model), on pages the process never had (after a trim) and
on pages its heap has (what most of each warming is: each recording takes the warm heap).
Both fault in the same pages. Prints each way's milliseconds and page faults, alternating,
and the medians. Run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/training-issue24/warm_touch.py [--rounds 5]
"""

import argparse
import contextlib
import ctypes
import statistics
import threading
import time
from unittest import mock

import engine.malloc_tuning as malloc_tuning
from engine.malloc_tuning import HeapWarmer, keep_freed_memory, minor_page_faults, return_freed_memory

PIECE_BYTES, PIECES = 2_641_920, 155


def warm(fresh: bool) -> tuple[float, int]:
    """(seconds, page faults) of warming the heap once; `fresh`: after a trim."""
    warmer = HeapWarmer()
    warmer.fit([PIECE_BYTES] * PIECES)
    if fresh:
        return_freed_memory()
    faults, started = minor_page_faults(), time.perf_counter()
    while warmer.grow():
        pass
    seconds, faults = time.perf_counter() - started, minor_page_faults() - faults
    warmer.release()
    return seconds, faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    keep_freed_memory()
    ways = {"page": None, "memset": lambda address, size: ctypes.memset(address, 0, size)}
    results = {(way, fresh): [] for way in ways for fresh in (True, False)}

    def rounds():
        for r in range(args.rounds):
            for way in (ways if r % 2 else reversed(list(ways))):
                touch = ways[way]
                with mock.patch.object(malloc_tuning, "_touch_pages", touch) if touch else contextlib.nullcontext():
                    for fresh in (True, False):
                        seconds, faults = warm(fresh)
                        results[(way, fresh)].append(seconds)
                        print(f"round {r} {way:6} {'fresh' if fresh else 'reused'}: {seconds * 1000:.1f} ms, "
                              f"{faults} page faults", flush=True)

    thread = threading.Thread(target=rounds)  # a thread's own arena, as the device thread's
    thread.start()
    thread.join()
    for fresh in (True, False):
        page, whole = (statistics.median(results[(way, fresh)]) for way in ("page", "memset"))
        print(f"median, {'fresh' if fresh else 'reused'} pages: a byte per page {page * 1000:.1f} ms, "
              f"every byte {whole * 1000:.1f} ms ({whole / page:.1f}x)")


if __name__ == "__main__":
    main()
