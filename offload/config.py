"""The activation offloader's configuration (`[offload]`; assembled in server/config.py)."""

from __future__ import annotations

from dataclasses import dataclass


OFFLOAD_POLICIES = ("hedged", "load", "recompute")


@dataclass(frozen=True)
class OffloadConfig:
    # bytes the recorded activations and a serving step's transient memory may use on the
    # device together; 0: unlimited (no offloader: every recorded layer stays resident)
    device_budget_bytes: int = 0
    # the preallocated (pinned on CUDA) host pool freed layers are copied into
    host_budget_bytes: int = 2 << 30
    # how freed layers come back for backward: hedged (per layer, load or recompute,
    # whichever the measured costs favour), load (from the host copy), recompute
    policy: str = "hedged"
    # reloads issued this many layers ahead of the backward that needs them
    prefetch_layers: int = 2
    # a file written by `alchemist profile` (calibrated maps and timings); empty: calibrate at start
    profile: str = ""
    # when layers are copied to the host pool: "recording" (each layer as it is recorded,
    # on the copy stream — the paper's: freeing is then free), "freeing" (only the layers
    # freed, when they are), auto: recording on CUDA (a separate copy engine), freeing on
    # CPU (where the copy takes the cores the prefill runs on)
    copy_to_host: str = "auto"

    def __post_init__(self) -> None:
        if self.policy not in OFFLOAD_POLICIES:
            raise ValueError(f"offload.policy must be one of {OFFLOAD_POLICIES}, got {self.policy!r}")
        if self.copy_to_host not in ("auto", "recording", "freeing"):
            raise ValueError(f"offload.copy_to_host must be auto, recording or freeing, got {self.copy_to_host!r}")
        for name in ("device_budget_bytes", "host_budget_bytes", "prefetch_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"offload.{name} must be a non-negative integer, got {value!r}")
