"""Fresh heap memory written the way a recording writes it (400 tensors of 600 KiB, on the
main thread and on a second thread, whose allocations come from another glibc arena):
the page faults and the seconds. Run it twice, with and without glibc's malloc asking for
transparent huge pages (glibc reads its tunables at start only), from the repository root:

    .venv/bin/python docs/training-issue24/huge_page_heap.py
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 .venv/bin/python docs/training-issue24/huge_page_heap.py
"""

import os
import threading
import time

import torch

from engine.malloc_tuning import keep_freed_memory, minor_page_faults


def write_fresh(results: list) -> None:
    faults, started = minor_page_faults(), time.perf_counter()
    kept = [torch.ones(150 << 10) for _ in range(400)]  # 400 x 600 KiB, as a recording's tensors
    results.append((minor_page_faults() - faults, time.perf_counter() - started, len(kept)))


def main() -> None:
    keep_freed_memory()
    print("GLIBC_TUNABLES:", os.environ.get("GLIBC_TUNABLES", ""))
    for where in ("main thread", "second thread"):
        results: list = []
        if where == "main thread":
            write_fresh(results)
        else:
            thread = threading.Thread(target=write_fresh, args=(results,))
            thread.start()
            thread.join()
        faults, seconds, _ = results[0]
        print(f"{where}: {faults} page faults, {seconds * 1000:.1f} ms")


if __name__ == "__main__":
    main()
