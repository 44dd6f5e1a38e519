"""Copies between device memory and the host pool, off the compute path.

On CUDA: one side stream, ordered after the computation that produced the source, with
an event per copy; a reloaded tensor is used only after its event completed, and `record_stream` keeps the caching allocator from reusing a source or
destination while its copy is in flight. On CPU: one worker thread (tensor copies
release the GIL), so that the same code paths — issue now, wait later — run here.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class CopyHandle:
    """One copy in flight. `wait()` blocks until the destination may be used by the
    compute stream, and returns the seconds spent waiting."""

    def __init__(self, future: Future | None = None, event=None):
        self._future = future
        self._event = event

    def wait(self) -> float:
        started = time.perf_counter()
        if self._event is not None:
            self._event.synchronize()
        else:
            self._future.result()
        return time.perf_counter() - started


class CopyStream:
    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._pool = None
        else:
            self._stream = None
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="alchemist-copy")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        """dst.copy_(src), asynchronously."""
        if self._stream is None:
            return CopyHandle(future=self._pool.submit(dst.copy_, src))
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        for tensor in (dst, src):
            if tensor.is_cuda:
                tensor.record_stream(self._stream)
        return CopyHandle(event=event)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
