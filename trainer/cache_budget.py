"""How many bytes of recorded activations the activation cache may hold.

`train.cache_bytes` set to a number is that number. Set to 0 (the default), it is sized
to the device when the server starts, after the weights and the KV cache are allocated:
on a GPU, half the memory then free (the other half stays for training jobs, CUDA
graphs and serving's transients); on the CPU (and any other device), where recordings
share the memory with everything else, a fixed 2 GiB. A recording of the Llama-3.1-8B
shape keeps 32 layers x 108 KiB per prompt token, so a fixed 2 GiB would hold two or three
chat prompts on a GPU node and almost every labelled entry would be recomputed. With an
offload device budget, the offloader bounds what stays on the device; this bounds the
entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload.memory_model import MemoryModel

CPU_CACHE_BYTES = 2 << 30
GPU_FREE_SHARE = 0.5


@dataclass(frozen=True)
class CacheBudget:
    budget_bytes: int
    # how the budget was chosen, for the start-up log
    source: str
    # recorded bytes per prompt token of this model (the analytic memory model)
    bytes_per_token: int

    @property
    def tokens(self) -> int:
        """Prompt tokens of recordings the budget holds."""
        return self.budget_bytes // max(self.bytes_per_token, 1)


def free_device_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0]


def recorded_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """What one recorded prompt token keeps, every layer and the head (analytic)."""
    memory = MemoryModel.analytic(model_config, dtype.itemsize, max_model_len=1)
    return int(memory.recording_bytes(1) + memory.head_per_token)


def size_cache(configured: int, device: torch.device, model_config, dtype: torch.dtype,
               free_bytes: Callable[[torch.device], int] = free_device_bytes) -> CacheBudget:
    """The cache's budget: `configured` bytes, or with 0 sized to `device` (see above)."""
    per_token = recorded_bytes_per_token(model_config, dtype)
    if 0 < configured < per_token:  # every prompt would be served unrecorded, and nothing would train on one
        raise ValueError(f"train.cache_bytes = {configured} holds no recorded prompt token: one takes {per_token} "
                         "bytes on this model (the setting is in bytes, 2 GiB is 2147483648; 0 sizes it to the device)")
    if configured > 0:
        return CacheBudget(configured, "train.cache_bytes", per_token)
    if device.type == "cuda":
        free = free_bytes(device)
        return CacheBudget(int(free * GPU_FREE_SHARE), f"half of the {free / 2**30:.1f} GiB free on {device}",
                           per_token)
    return CacheBudget(CPU_CACHE_BYTES, f"the default on {device.type}", per_token)
