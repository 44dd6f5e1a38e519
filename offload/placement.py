"""Where one recording's layer segments live: on the device, in the host pool, or
nowhere (dropped, to be recomputed from the segment's kept input).

A segment's saved tensors are grouped by the storage they view; a storage moves as a
whole and every saved tensor viewing it is re-pointed at the copy when it comes back.
Storages a segment does not own stay on the device and count as kept: the segment's own
leaf, output and K/V (the next layer's input, the responses' prefix), storages saved by
several layers (the rotary tables) and the head segment. Storages are named by address,
which is only valid while they are resident: a freed storage's address is forgotten.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field

import torch

from engine.recording import LayerSegment, RecordedPrefill, SavedTensor
from offload.copy_stream import CopyHandle
from offload.host_pool import HostBlock


class Residence(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DROPPED = "dropped"
    DONE = "done"  # back-propagated and released


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def byte_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage of `tensor`."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


@dataclass(eq=False)
class StorageCopy:
    # the device storage's address when recorded (valid only while it is resident)
    key: int
    nbytes: int
    # uint8 alias of the device storage while it is resident
    device: torch.Tensor | None
    # saved tensors that view this storage
    handles: list[weakref.ref]
    host: HostBlock | None = None
    to_host: CopyHandle | None = None
    to_device: CopyHandle | None = None
    # the device buffer a reload is filling
    loading: torch.Tensor | None = None
    # (handle, dtype, storage offset, size, stride) of each view while not resident
    views: list[tuple[weakref.ref, torch.dtype, int, tuple, tuple]] = field(default_factory=list)


@dataclass(eq=False)
class LayerPlacement:
    index: int
    segment: LayerSegment
    storages: list[StorageCopy]
    residence: Residence = Residence.DEVICE
    # a reload of this layer is in flight
    loading: bool = False

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.storages)


class RecordingPlacement:
    """One recording's segments, as the offloader sees them (engine.recording.SegmentPlacement)."""

    def __init__(self, offloader, num_tokens: int, sequence: int, rows: int):
        self.offloader = offloader
        self.num_tokens = num_tokens  # the prompt's: a layer recomputed runs these rows alone
        self.rows = rows  # the recorded step's (the riding decodes' too): what its saved inputs hold
        # registration order: later recordings are trained later, so they are freed first
        self.sequence = sequence
        self.layers: list[LayerPlacement] = []
        self.kept_bytes = 0
        # storage key -> the layer storage owning it (None: kept)
        self._owners: dict[int, StorageCopy | None] = {}
        self.released = False
        # a training job is back-propagating this recording: free it last
        self.active = False
        # tokens of the prompt's cached beginning before the recorded ones, and per layer where
        # their K/V gradients accumulate (RecordedPrefill.prefix_grads): a dropped layer is
        # recomputed attending to the beginning's rows of its kept K/V, handing them on
        self.prefix_len = 0
        self.prefix_grads: list = []

    def cached_prefix(self, index: int) -> tuple[torch.Tensor, torch.Tensor, object] | None:
        """Layer `index`'s cached beginning, as `recompute_segment` takes it (None: none)."""
        if not self.prefix_len:
            return None
        segment = self.layers[index].segment
        num = self.prefix_len
        return segment.key[:, :, :num], segment.value[:, :, :num], self.prefix_grads[index]

    def _keep(self, key: int, nbytes: int) -> None:
        if key not in self._owners:
            self._owners[key] = None
            self.kept_bytes += nbytes
            self.offloader.account(nbytes)

    def add_segment(self, index: int, segment: LayerSegment, saved: list[SavedTensor]) -> None:
        for tensor in (segment.leaf, segment.out, segment.key, segment.value):
            self._keep(storage_key(tensor), tensor.untyped_storage().nbytes())
        by_storage: dict[int, list[SavedTensor]] = {}
        for handle in saved:
            if handle.tensor is not None and handle.key not in self.offloader.param_keys:
                by_storage.setdefault(storage_key(handle.tensor), []).append(handle)
        storages = []
        for key, handles in by_storage.items():
            nbytes = handles[0].tensor.untyped_storage().nbytes()
            if key in self._owners:
                owner = self._owners[key]
                if owner is not None:  # saved by an earlier layer too: shared, so kept
                    self.offloader.disown(self, owner)
                    self._owners[key] = None
                    self.kept_bytes += nbytes
                continue
            copy = StorageCopy(key, nbytes, byte_alias(handles[0].tensor), [weakref.ref(h) for h in handles])
            self._owners[key] = copy
            storages.append(copy)
        layer = LayerPlacement(index, segment, storages)
        self.layers.append(layer)
        self.offloader.layer_registered(self, layer)

    def keep(self, *tensors: torch.Tensor) -> None:
        """Tensors every layer uses (the rotary tables): kept on the device."""
        for tensor in tensors:
            self._keep(storage_key(tensor), tensor.untyped_storage().nbytes())

    def forget(self, storage: StorageCopy) -> None:
        """A freed storage's address may be reused by a new tensor: it no longer names it."""
        if self._owners.get(storage.key) is storage:
            del self._owners[storage.key]

    def finish(self, recording: RecordedPrefill, head_saved: list[SavedTensor]) -> None:
        """The head segment (final norm and LM head) and the logits stay on the device."""
        self.prefix_len, self.prefix_grads = recording.prefix_len, recording.prefix_grads
        for tensor in [recording.head_leaf, recording.logits] + [h.tensor for h in head_saved if h.tensor is not None]:
            if tensor.untyped_storage().data_ptr() not in self.offloader.param_keys:
                self._keep(storage_key(tensor), tensor.untyped_storage().nbytes())
        self.offloader.recording_finished(self)

    def release(self) -> None:
        self.offloader.release_recording(self)
