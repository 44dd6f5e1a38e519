"""Host memory for recorded activations: keep freed memory for reuse, and give it back
between training jobs (glibc).

Recorded prefills and training jobs allocate hundreds of MB of activations of every
size and free them soon after. With glibc's defaults, blocks above the (dynamic) mmap
threshold are mapped fresh each time, so every recording pays first-touch page faults
(a profile of a recorded prefill showed its elementwise ops slowed by them).
  - `keep_freed_memory()` raises the mmap threshold to its maximum (32 MiB) and keeps up
    to 1 GiB of freed heap (what it gains DPO training, `alchemist bench training --mode
    dpo`, is measured in BENCHMARKS.md, History, "Production: soak", fix 4).
  - `return_freed_memory()` (`malloc_trim(0)`, every arena) gives free heap pages back to
    the OS. The trainer calls it as an idle item once prefills have stopped being
    recorded for a while (beyond a slack while the pause is short: the recording after a
    trim pays its page faults), and again, at most as often, while jobs free more, so a
    server without traffic holds what it started with (trainer/maintenance.py; `alchemist
    bench soak`; measured in BENCHMARKS.md, "Memory after the drain", "A pause in traffic").
Elsewhere than glibc both do nothing and return False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource

import torch

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both must exist (glibc)
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Keeps freed blocks in the heap for reuse; True if glibc accepted the settings."""
    libc = _libc()
    if libc is None:
        return False
    return all(libc.mallopt(option, value) == 1 for option, value in (
        (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20)))


def return_freed_memory() -> bool:
    """Returns free heap pages to the OS; False where glibc's malloc_trim is missing."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def resident_anonymous_bytes() -> int | None:
    """Resident memory of this process not backed by files (its heaps and anonymous
    mappings: RSS less its shared pages); None where /proc is missing."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            fields = statm.read().split()
        return (int(fields[1]) - int(fields[2])) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None


def minor_page_faults() -> int:
    """Minor page faults this process has taken: host memory touched for the first time
    since it was mapped (a serving step's count says whether it wrote to fresh pages)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# The heap is warmed in pieces the size of the largest tensor the largest recording
# saved (its MLP rows): glibc hands out its free chunks best fit first, and freed, the pieces
# are chunks that every tensor of the recording fits. Pieces of a fixed size miss them,
# depending on the heap: 16 MiB pieces went to the top of the heap, 64 KiB ones to holes
# a recording's larger tensors do not fit, and so did pieces of the recording's own sizes,
# grown between other work (docs/training-issue24/recorded_prefill_under_backlog.py,
# warm_heap_pieces.py).
_FALLBACK_PIECE = 1 << 20
# the work of one `grow()`, in bytes touched
_GROW_BYTES = 16 << 20
# glibc maps blocks from this size (keep_freed_memory) fresh when no free chunk fits them:
# pieces this large would not stay in the heap
_MMAP_THRESHOLD = 32 << 20
_PAGE_BYTES = resource.getpagesize()


def _touch_pages(address: int, size: int) -> None:
    """Writes a byte in every page of [address, address + size): a page the process never
    had faults in, one the heap had costs a cache miss, not a write of every byte (each
    recording takes the warm heap, so most of it is warmed again on pages the heap has)."""
    pages = torch.frombuffer((ctypes.c_char * size).from_address(address), dtype=torch.uint8)
    pages[::_PAGE_BYTES].zero_()
    pages[-1:].zero_()


class HeapWarmer:
    """Pre-faulted heap for the next recording: wherever the device has a moment (between
    jobs, between a job's slices, after serving steps: trainer/maintenance.py), `grow()`
    touches fresh heap pages, a slice of work at a time, and holds them; `release()` (just
    before a recording) frees them, so the recording's activations land on pages that no
    longer fault on first touch. A recording made while earlier ones are alive otherwise takes fresh
    pages (`alchemist bench recording`, cases kept and kept_cold; measured in
    BENCHMARKS.md, "Recording"). Needs `keep_freed_memory()`; does nothing elsewhere than
    glibc."""

    def __init__(self, max_bytes: int = 512 << 20):
        self.max_bytes = max_bytes
        # bytes to hold warm: the largest recording seen (`fit`)
        self.target = 0
        # the size of that recording's largest saved tensor: the pieces'
        self.piece_bytes = _FALLBACK_PIECE
        self._pieces: list[int] = []
        self._held = 0
        self._libc = _libc()
        if self._libc is not None:
            self._libc.malloc.restype = ctypes.c_void_p
            self._libc.malloc.argtypes = [ctypes.c_size_t]
            self._libc.free.argtypes = [ctypes.c_void_p]

    @property
    def held_bytes(self) -> int:
        return self._held

    def fit(self, saved_sizes: list[int]) -> None:
        """A recording saved tensors of these sizes (bytes): the heap is warmed for the
        largest recording seen, in pieces the size of its largest tensor."""
        sizes = [size for size in saved_sizes if size < _MMAP_THRESHOLD]
        if sizes and sum(sizes) > self.target:
            self.target, self.piece_bytes = sum(sizes), max(sizes)

    def wants_to_grow(self) -> bool:
        return self._libc is not None and self.held_bytes < min(self.target, self.max_bytes)

    def grow(self) -> bool:
        """Touches pieces until `_GROW_BYTES` more are touched or the heap is warm enough
        (a bounded slice of work: at least one piece); False if it was warm enough."""
        grew = 0
        while grew < _GROW_BYTES and self.wants_to_grow():
            size = self.piece_bytes
            address = self._libc.malloc(size)
            if not address:
                self.target = self.held_bytes  # out of memory: stay as warm as we are
                break
            _touch_pages(address, size)  # the first touch: the page faults happen here
            self._pieces.append(address)
            self._held += size
            grew += size
        return grew > 0

    def release(self) -> None:
        """Frees the held pages into the heap, warm, for the allocations that follow."""
        pieces, self._pieces, self._held = self._pieces, [], 0
        for address in reversed(pieces):
            self._libc.free(address)
