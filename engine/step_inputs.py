"""A serving step's inputs: shapes from a few buckets, built on the host, copied at once.

Two things make a GPU step cost more host time than device time (DESIGN.md, "On a GPU:
the decode step"), and both are settled here:

- **Shapes.** Attention's batch, query and key lengths are rounded up to buckets
  (`StepBuckets`), so that a server under traffic reuses a bounded set of attention
  shapes — a fused kernel's graph, or a captured CUDA graph, per shape — instead of one
  new shape per step as contexts grow by a token. Padded sequences and keys are masked.
- **Copies.** Everything a step computes from the host's bookkeeping (token ids,
  positions, cache slots, block tables, sampling parameters) is written into one pinned
  host buffer per dtype through a numpy view and copied to the device in one
  non-blocking copy per dtype (`HostStaging`), as vLLM's input batch does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# the smallest key-length bucket: below it, a step's attention is cheap whatever its padding
_MIN_KEY_BUCKET = 16
# elements each staging buffer starts with (it doubles when a step needs more)
_STAGING_ELEMENTS = 1 << 16
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool}


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class StepBuckets:
    """Rounds attention's dimensions up to powers of two: batch and query length, and the
    key length (at least `min_keys`, a multiple of the KV block size)."""

    block_size: int
    min_keys: int = _MIN_KEY_BUCKET

    def batch(self, num_seqs: int) -> int:
        return next_power_of_two(num_seqs)

    def query(self, max_query: int) -> int:
        return next_power_of_two(max_query)

    def keys(self, max_context: int) -> int:
        keys = next_power_of_two(max(max_context, self.min_keys))
        return -(-keys // self.block_size) * self.block_size


class HostStaging:
    """Copies named host arrays to the device, one copy per dtype.

    Each dtype has a host buffer (pinned on CUDA) written through a numpy view made once,
    so that filling it reads no tensor; `upload` copies the used part to a fresh device
    tensor (non-blocking from pinned memory) and returns views of it by name. Before a
    buffer is written again, the copy that last read it has finished (a CUDA event)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pin = device.type == "cuda"
        self._host: dict[np.dtype, tuple[torch.Tensor, np.ndarray]] = {}
        self._copied: dict[np.dtype, torch.cuda.Event] = {}

    def _buffer(self, dtype: np.dtype, size: int) -> tuple[torch.Tensor, np.ndarray]:
        held = self._host.get(dtype)
        if held is None or held[1].size < size:
            capacity = max(size, 2 * held[1].size if held is not None else _STAGING_ELEMENTS)
            tensor = torch.empty(capacity, dtype=_TORCH_DTYPES[dtype], pin_memory=self._pin)
            held = self._host[dtype] = (tensor, tensor.numpy())
        return held

    def upload(self, **arrays: np.ndarray) -> dict[str, torch.Tensor]:
        groups: dict[np.dtype, list[tuple[str, np.ndarray]]] = {}
        for name, array in arrays.items():
            groups.setdefault(array.dtype, []).append((name, array))
        out: dict[str, torch.Tensor] = {}
        for dtype, named in groups.items():
            size = sum(array.size for _, array in named)
            event = self._copied.pop(dtype, None)
            if event is not None:
                event.synchronize()
            host, view = self._buffer(dtype, size)
            offset = 0
            for _, array in named:
                view[offset:offset + array.size] = array.ravel()
                offset += array.size
            copied = host[:size].to(self.device, non_blocking=self._pin, copy=True)
            if self._pin:
                self._copied[dtype] = torch.cuda.Event()
                self._copied[dtype].record()
            offset = 0
            for name, array in named:
                out[name] = copied[offset:offset + array.size].view(array.shape)
                offset += array.size
        return out
