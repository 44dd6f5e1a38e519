"""The host memory offloaded activations are copied into: one preallocated buffer (pinned
when the device is CUDA, so that copies are asynchronous DMA), carved by a first-fit
allocator. Its size is the host byte budget: an allocation that does not fit gets None,
and the caller keeps the activation on the device or drops it for recomputation."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import torch

_ALIGN = 64


@dataclass(eq=False)
class HostBlock:
    offset: int
    nbytes: int
    # uint8 view of the pool: [offset, offset + nbytes)
    data: torch.Tensor


class HostPool:
    def __init__(self, capacity_bytes: int, pin: bool):
        self.capacity = capacity_bytes
        self.buffer = torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=pin)
        # free extents (offset, size), sorted by offset and never adjacent
        self._free: list[tuple[int, int]] = [(0, capacity_bytes)] if capacity_bytes else []
        self.used_bytes = 0
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> HostBlock | None:
        size = -(-nbytes // _ALIGN) * _ALIGN
        with self._lock:
            for i, (offset, extent) in enumerate(self._free):
                if extent >= size:
                    if extent == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, extent - size)
                    self.used_bytes += size
                    return HostBlock(offset, size, self.buffer[offset:offset + nbytes])
        return None

    def free(self, block: HostBlock) -> None:
        with self._lock:
            self.used_bytes -= block.nbytes
            i = bisect.bisect(self._free, (block.offset, 0))
            offset, size = block.offset, block.nbytes
            if i < len(self._free) and offset + size == self._free[i][0]:  # merge with the next extent
                size += self._free.pop(i)[1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and with the previous
                offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
                i -= 1
                del self._free[i]
            self._free.insert(i, (offset, size))
