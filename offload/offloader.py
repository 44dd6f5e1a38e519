"""The activation offloader: keeps the recorded activations within a device byte budget
(paper §4.3) and brings freed layers back for training, hidden behind backward.

- Recording: each layer segment is registered as soon as it is recorded and, if the host
  pool has room, copied to it at once on the copy stream, so that freeing it later costs
  nothing (`offload.copy_to_host`: the paper's way, the default on CUDA; on CPU a layer
  is copied only when it is freed). If the recording alone would exceed the budget, its
  layers are freed as they are recorded (the paper's direct offload).
- Before each serving step the engine calls `before_step`: the offloading map gives the
  step's bytes, and layers are freed until the cached activations fit beside it — newest
  recording first (trained last), within it layer 0 first (needed last in backward).
  Freeing a layer with a host copy drops its device storage; without one it is dropped
  for recomputation.
- Training: `residency(recording)` plans, per freed layer, load or recompute
  (offload/hedging.py); reloads are issued `prefetch_layers` ahead in reverse layer order
  on the copy stream while the layers above back-propagate.

On CPU the "device" is the budget this class accounts for; the data really moves (into
the host pool and back) and recomputation really runs, so the logic is the CUDA one.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from offload.config import OffloadConfig
from engine.recording import LayerSegment, RecordedPrefill, SavedTensor
from offload.copy_stream import CopyStream
from offload.hedging import Timings
from offload.host_pool import HostPool
from offload.memory_model import OffloadingMap
from offload.placement import LayerPlacement, RecordingPlacement, Residence, StorageCopy
from offload.residency import Residency

logger = logging.getLogger(__name__)

# the memory model is calibrated on single-sequence layers; a recorded step pads its
# attention to the longest sequence beside it, which the model bounds only approximately
_IN_FLIGHT_MARGIN = 1.25

# recompute(layer index, the layer's kept input rows (1, T, hidden)[, the prompt's cached
# beginning at that layer: its K/V rows and their gradients' sink]) -> a fresh segment
# (trainer.forward.recompute_segment)
RecomputeFn = Callable[..., LayerSegment]


@dataclass
class OffloadStats:
    offloaded_layers: int = 0   # freed to the host pool
    dropped_layers: int = 0     # freed without a host copy (recomputed later)
    reloaded_layers: int = 0
    recomputed_layers: int = 0
    reload_wait_seconds: float = 0.0
    # steps before which the budget could not be met (only kept tensors were left)
    over_budget_steps: int = 0
    # the most the cached activations held on the device
    peak_device_bytes: int = 0
    # the most they held plus the running serving step's bytes (what the budget bounds)
    peak_budget_bytes: int = 0
    # layers of training forwards (a recomputation's, a cached beginning's) run again in
    # backward from their kept input, their graphs not fitting (TrainContext.graph_layers)
    rerun_training_layers: int = 0


class ActivationOffloader:
    def __init__(self, config: OffloadConfig, device: torch.device, offloading_map: OffloadingMap,
                 timings: Timings, param_keys: set[int], recompute: RecomputeFn):
        self.config = config
        self.device = device
        self.map = offloading_map
        self.timings = timings
        self.param_keys = param_keys
        self.recompute = recompute
        self.pool = HostPool(config.host_budget_bytes, pin=device.type == "cuda")
        self.copies = CopyStream(device)
        self.stats = OffloadStats()
        self.device_bytes = 0
        # what the cached activations may use during the coming serving step, and its bytes
        self._allowed_bytes = config.device_budget_bytes
        self._step_bytes = 0
        # the largest serving step's bytes seen: what never-freed tensors must leave room for
        self._max_step_bytes = 0
        # the most sequences a serving step has held: bounds the decodes that may ride along
        # in a recorded prefill's step (its graph holds their rows too)
        self._max_batch = 0
        # the most kept bytes per recorded token seen (predicts a new recording's kept bytes),
        # and per token of a cached beginning it read (the memory model's: its K/V, exact)
        self._kept_per_token = offloading_map.model.kept_per_token
        self._kept_per_cached_token = offloading_map.model.kept_per_cached_token or self._kept_per_token
        self._layer_per_token = 0.0
        self._recordings: list[RecordingPlacement] = []
        self._sequence = 0
        self._lock = threading.RLock()

    @property
    def copy_while_recording(self) -> bool:
        mode = self.config.copy_to_host
        return mode == "recording" or (mode == "auto" and self.device.type == "cuda")

    @property
    def budget_bytes(self) -> int:
        return self.config.device_budget_bytes

    @property
    def host_bytes(self) -> int:
        return self.pool.used_bytes

    # -- accounting ---------------------------------------------------------------------

    @property
    def kept_bytes(self) -> int:
        return sum(r.kept_bytes for r in self._recordings)

    def admits(self, num_tokens: int, cached_tokens: int = 0) -> bool:
        """Whether a recorded prefill of a `num_tokens` prompt may run now, its first
        `cached_tokens` read from the prefix cache (of which it keeps the keys and values
        only): its kept tensors (never freed) and what its step holds before a layer can be
        freed (as `before_step` will reckon it: the rows it computes, and as many decodes
        riding along as the fullest step seen held) fit beside everything kept now and its
        own step. If not, the prefill runs unrecorded. Later steps must fit too: the room
        left is for the largest serving step seen. Asked when it is admitted and again when
        its step is scheduled (the prefix cache may hold less of its beginning by then)."""
        recorded = num_tokens - cached_tokens
        with self._lock:
            kept = self._kept_per_token * recorded + self._kept_per_cached_token * cached_tokens
            need = self.kept_bytes + int(kept) + self.in_flight_bytes(recorded + max(self._max_batch - 1, 0))
            # (its attention scores the cached keys too)
            scores = int(self.map.model.step_per_score * recorded * cached_tokens)
            step = max(self.map.serving_bytes(recorded, 1) + scores, self._max_step_bytes)
            return need + step <= self.budget_bytes

    def reload_room(self) -> int:
        """Device bytes the cached activations may use with reloads in flight: the budget
        less the largest serving step seen (reloads cannot be freed for a step)."""
        with self._lock:
            return self.budget_bytes - self._max_step_bytes

    def graph_fits(self, num_tokens: int) -> bool:
        """Whether a training forward of `num_tokens` rows, every layer's graph alive,
        fits in the room reloads may use beside what the recordings hold on the device."""
        return self.graph_layers_fit(num_tokens) == self.map.model.num_layers

    def graph_layers_fit(self, num_tokens: int) -> int:
        """How many layers' training graphs of `num_tokens` rows fit at once in the room
        reloads may use beside what the recordings hold on the device: all, or as many as
        fit beside every layer's input kept (each layer's kept tensors per token bound an
        input's bytes), the others run again from their input."""
        with self._lock:
            model = self.map.model
            room = self.budget_bytes - self._max_step_bytes - self.device_bytes
            if model.num_layers * self.layer_bytes(num_tokens) <= room:
                return model.num_layers
            kept_per_layer = (model.kept_per_token - model.head_per_token) / max(model.num_layers, 1)
            room -= int(model.num_layers * kept_per_layer * num_tokens)
            return max(0, min(model.num_layers, room // max(self.layer_bytes(num_tokens), 1)))

    def kept_fit(self) -> bool:
        """Whether the never-freed tensors of the recordings held now leave room for the
        largest serving step seen (else the trainer gives up its stale recordings)."""
        with self._lock:
            return self.kept_bytes + self._max_step_bytes <= self.budget_bytes

    # -- the interface of placement.py and residency.py --------------------------------
    # (what a recording's placement and a backward's residency change in the accounting)

    def account(self, delta: int) -> None:
        """`delta` bytes of recorded activations arrived on (or left) the device."""
        self.device_bytes += delta
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.device_bytes)
        self.stats.peak_budget_bytes = max(self.stats.peak_budget_bytes, self.device_bytes + self._step_bytes)

    # -- recording (engine.recording.SegmentSink) ---------------------------------------

    def begin_recording(self, num_tokens: int, rows: int) -> RecordingPlacement:
        with self._lock:
            self._sequence += 1
            placement = RecordingPlacement(self, num_tokens, self._sequence, rows)
            self._recordings.append(placement)
            return placement

    def layer_registered(self, recording: RecordingPlacement, layer: LayerPlacement) -> None:
        """A layer of `recording` finished recording: it is accounted, copied to the host
        when copies are eager, and layers are freed if the budget is exceeded."""
        with self._lock:
            self._layer_per_token = max(self._layer_per_token, layer.nbytes / max(recording.rows, 1))
            self.account(layer.nbytes)
            if self.config.policy != "recompute" and self.copy_while_recording:
                for storage in layer.storages:
                    self._copy_to_host(storage)
            # a recording larger than the budget on its own: free its layers as they come
            self.free_to(self._allowed_bytes)

    def recording_finished(self, recording: RecordingPlacement) -> None:
        """A recording's kept tensors are all known: they refine the prediction of a new
        recording's kept bytes, and its layers are freed to the step's allowance."""
        with self._lock:
            kept = recording.kept_bytes - self._kept_per_cached_token * recording.prefix_len
            self._kept_per_token = max(self._kept_per_token, kept / max(recording.rows, 1))
            self.free_to(self._allowed_bytes)

    def _copy_to_host(self, storage: StorageCopy) -> bool:
        if storage.host is None:
            storage.host = self.pool.allocate(storage.nbytes)
            if storage.host is None:
                return False
            storage.to_host = self.copies.copy(storage.host.data, storage.device)
        return True

    def disown(self, recording: RecordingPlacement, storage: StorageCopy) -> None:
        """A resident storage turned out to be saved by a later layer too: it is kept on
        the device from now on (its bytes move from the layer to the kept bytes)."""
        for layer in recording.layers:
            if storage in layer.storages:
                layer.storages.remove(storage)
        self._free_host(storage)

    def _free_host(self, storage: StorageCopy) -> None:
        if storage.host is not None:
            if storage.to_host is not None:
                storage.to_host.wait()
            self.pool.free(storage.host)
            storage.host = storage.to_host = None

    # -- freeing -------------------------------------------------------------------------

    def layer_bytes(self, num_tokens: int) -> int:
        """A recorded layer's offloadable bytes: the memory model, or the most seen per token."""
        return max(self.map.model.layer_bytes(num_tokens), int(self._layer_per_token * num_tokens))

    def in_flight_bytes(self, rows: int) -> int:
        """What a recorded prefill of `rows` tokens holds before its layers can be freed."""
        estimate = self.map.model.recording_in_flight_bytes(rows)
        return int(max(self.layer_bytes(rows), estimate) * _IN_FLIGHT_MARGIN)

    def before_step(self, num_tokens: int, batch_size: int, recorded_tokens: int = 0) -> None:
        """Frees layers so that the cached activations fit beside a serving step (and, for
        a recorded step, one layer of the new recording before it can be freed)."""
        with self._lock:
            self._step_bytes = self.map.serving_bytes(num_tokens, batch_size)
            self._max_step_bytes = max(self._max_step_bytes, self._step_bytes)
            self._max_batch = max(self._max_batch, batch_size)
            in_flight = 0
            if recorded_tokens:  # the rows the recorded graph holds: the prompt's, and any riding decodes'
                in_flight = self.in_flight_bytes(recorded_tokens)
            self._allowed_bytes = max(0, self.budget_bytes - self._step_bytes - in_flight)
            if not self.free_to(self._allowed_bytes):
                self.stats.over_budget_steps += 1
            self.account(0)

    def after_step(self) -> None:
        """The serving step's memory is free again (training reloads may use it)."""
        with self._lock:
            self._allowed_bytes, self._step_bytes = self.budget_bytes, 0

    def free_to(self, allowed_bytes: int) -> bool:
        """Frees layers, newest recording first and layer 0 first, until the device bytes
        are at most `allowed_bytes`; False if only kept tensors are left above it."""
        with self._lock:
            if self.device_bytes <= allowed_bytes:
                return True
            order = sorted(self._recordings, key=lambda r: (r.active, -r.sequence))
            for recording in order:
                for layer in recording.layers:
                    if self.device_bytes <= allowed_bytes:
                        return True
                    if layer.residence is Residence.DEVICE and not layer.loading and layer.nbytes:
                        self.free_layer(recording, layer)
            return self.device_bytes <= allowed_bytes

    def free_layer(self, recording: RecordingPlacement, layer: LayerPlacement) -> None:
        """Drops a resident layer's device storages: to the host copy, or for recompute."""
        for storage in layer.storages:
            for ref in storage.handles:
                handle = ref()
                if handle is not None and handle.tensor is not None and handle.tensor._version != handle.version:
                    return  # modified in place since saved: stay, so that backward raises
        to_host = self.config.policy != "recompute" and all(self._copy_to_host(s) for s in layer.storages)
        for storage in layer.storages:
            if to_host:
                storage.to_host.wait()
            else:
                self._free_host(storage)
            storage.views = []
            for ref in storage.handles:
                handle = ref()
                if handle is None or handle.tensor is None:
                    continue
                tensor = handle.tensor
                storage.views.append((ref, tensor.dtype, tensor.storage_offset(), tuple(tensor.shape),
                                      tuple(tensor.stride())))
                handle.fetch = self._fetch_now
                handle.rebind(None)
            storage.device = None
            recording.forget(storage)
        self.account(-layer.nbytes)
        layer.residence = Residence.HOST if to_host else Residence.DROPPED
        if to_host:
            self.stats.offloaded_layers += 1
        else:
            self.stats.dropped_layers += 1

    # -- reloading -------------------------------------------------------------------------

    def start_reload(self, layer: LayerPlacement) -> None:
        with self._lock:
            if layer.residence is not Residence.HOST or layer.loading:
                return
            layer.loading = True
            self.account(layer.nbytes)
            for storage in layer.storages:
                storage.loading = torch.empty(storage.nbytes, dtype=torch.uint8, device=self.device)
                storage.to_device = self.copies.copy(storage.loading, storage.host.data[:storage.nbytes])

    def finish_reload(self, layer: LayerPlacement) -> float:
        """Waits for the layer's reload and re-points its saved tensors; seconds waited."""
        self.start_reload(layer)
        waited = 0.0
        with self._lock:
            for storage in layer.storages:
                waited += storage.to_device.wait()
                device, storage.loading, storage.to_device = storage.loading, None, None
                for ref, dtype, offset, size, stride in storage.views:
                    handle = ref()
                    if handle is not None:
                        handle.rebind(torch.empty(0, dtype=dtype, device=self.device)
                                      .set_(device.untyped_storage(), offset, size, stride))
                storage.views = []
                storage.device = device
            layer.loading = False
            layer.residence = Residence.DEVICE
            self.stats.reloaded_layers += 1
            self.stats.reload_wait_seconds += waited
        return waited

    def _fetch_now(self, handle: SavedTensor) -> None:
        """A saved tensor unpacked while its layer is off the device and not planned."""
        with self._lock:
            for recording in self._recordings:
                for layer in recording.layers:
                    if any(ref() is handle for s in layer.storages for ref in s.handles):
                        if layer.residence is Residence.HOST:
                            self.finish_reload(layer)
                            return
                        raise RuntimeError(f"layer {layer.index}'s activations were dropped; "
                                           "it must be recomputed, not back-propagated")
        raise RuntimeError("a saved activation is no longer held by the offloader")

    # -- training --------------------------------------------------------------------------

    def residency(self, recording: RecordedPrefill) -> Residency | None:
        placement = recording.placement
        if not isinstance(placement, RecordingPlacement) or placement.offloader is not self:
            return None
        return Residency(self, placement)

    def release_layer(self, layer: LayerPlacement) -> None:
        """A layer is done with (back-propagated, or its recording released): its device
        and host copies are freed."""
        with self._lock:
            self._release_layer_locked(layer)

    def _release_layer_locked(self, layer: LayerPlacement) -> None:
        layer.segment = None
        if layer.residence is Residence.DONE:
            return
        if layer.residence is Residence.DEVICE or layer.loading:
            self.account(-layer.nbytes)
        for storage in layer.storages:
            if storage.to_device is not None:
                storage.to_device.wait()
            self._free_host(storage)
            storage.device = storage.loading = storage.to_device = None
            storage.views = []
        layer.loading = False
        layer.residence = Residence.DONE

    def release_recording(self, recording: RecordingPlacement) -> None:
        """The recording is trained or dropped: every byte of it is freed."""
        with self._lock:
            if recording.released:
                return
            recording.released = True
            for layer in recording.layers:
                self._release_layer_locked(layer)
            self.account(-recording.kept_bytes)
            recording.kept_bytes = 0
            self._recordings.remove(recording)

    def close(self) -> None:
        self.copies.close()
