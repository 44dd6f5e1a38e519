"""Brings one recording's freed layers back for its backward, top layer first.

On the first layer it plans, per freed layer, load or recompute (offload/hedging.py);
before each layer's backward it issues the reloads of the next planned-load layers
(`prefetch_layers` ahead, in the order backward needs them, within the device budget)
and waits for or recomputes the layer itself; after it, it releases the layer. The
costs it measures (recompute and backward per token) refine the planner's timings; on
a GPU they are timed by CUDA events, read once the last layer's backward is queued, so
that measuring them waits for the device once per recording rather than once per layer.
"""

from __future__ import annotations

import time

import torch

from engine.recording import LayerSegment
from offload.hedging import KEEP, LOAD, RECOMPUTE, plan
from offload.placement import RecordingPlacement, Residence


class Residency:
    """Brings one recording's layers onto the device for its backward, top to bottom
    (trainer.forward.backward_segments calls `before` and `after` around each layer)."""

    def __init__(self, offloader, placement: RecordingPlacement):
        self.offloader = offloader
        self.placement = placement
        self.choices: list[str] | None = None
        self._backward_started: float | torch.cuda.Event = 0.0
        self._backward_rows = 0
        self._timed: list[tuple] = []  # (observe, start mark, end mark, tokens), resolved after layer 0
        placement.active = True

    def _mark(self) -> float | torch.cuda.Event:
        """A point in time on the device's timeline: an event recorded on the current stream
        on a GPU (the host runs ahead of it), the host's clock on the CPU."""
        if self.offloader.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _resolve_timings(self) -> None:
        """Feeds the measured spans to the planner's timings, in the order they ran."""
        timed, self._timed = self._timed, []
        if timed and isinstance(timed[-1][2], torch.cuda.Event):
            timed[-1][2].synchronize()
        for observe, start, end, tokens in timed:
            seconds = end - start if isinstance(start, float) else start.elapsed_time(end) / 1e3
            observe(seconds, tokens)

    def _plan(self) -> None:
        offloader, layers = self.offloader, self.placement.layers
        resident = [layer.residence is Residence.DEVICE for layer in layers]
        costs = [offloader.timings.layer_costs(self.placement.num_tokens,
                                               layer.nbytes if layer.residence is Residence.HOST else None)
                 for layer in layers]
        policy = offloader.config.policy
        if policy == "hedged":
            self.choices, _ = plan(resident, costs, offloader.timings, offloader.config.prefetch_layers)
        else:
            self.choices = [KEEP if r else (LOAD if policy == "load" and c.reload_bytes is not None else RECOMPUTE)
                            for r, c in zip(resident, costs)]

    def _prefetch(self, index: int) -> None:
        """Issues reloads for the planned-load layers down to `index - prefetch`, in the
        order backward needs them, while the device budget has room beside the largest
        serving step (a reload in flight cannot be freed for a step that comes between)."""
        offloader = self.offloader
        for j in range(index, max(index - offloader.config.prefetch_layers, 0) - 1, -1):
            layer = self.placement.layers[j]
            if self.choices[j] == LOAD and layer.residence is Residence.HOST and not layer.loading:
                if j != index and offloader.device_bytes + layer.nbytes > offloader.reload_room():
                    break
                offloader.start_reload(layer)

    def before(self, index: int) -> LayerSegment:
        if self.choices is None:
            self._plan()
        layer = self.placement.layers[index]
        self._prefetch(index)
        if layer.residence is Residence.HOST and self.choices[index] == LOAD or layer.loading:
            self.offloader.finish_reload(layer)
        if layer.residence is Residence.DEVICE:
            segment = layer.segment
        else:  # dropped, or planned for recompute
            started = self._mark()
            num = self.placement.num_tokens
            rows = layer.segment.leaf[:, :num]
            prefix = self.placement.cached_prefix(index)
            segment = self.offloader.recompute(index, rows, prefix) if prefix else self.offloader.recompute(index, rows)
            self.offloader.stats.recomputed_layers += 1
            self._timed.append((self._observe_recompute, started, self._mark(), num))
        self._backward_started = self._mark()
        self._backward_rows = segment.out.shape[1]  # a kept layer's hold the riding decodes' rows too
        return segment

    def after(self, index: int) -> None:
        self._timed.append((self._observe_backward, self._backward_started, self._mark(), self._backward_rows))
        self.offloader.release_layer(self.placement.layers[index])
        if index == 0:
            self.placement.active = False
            self._resolve_timings()

    # measured costs refine the planner's timings (exponential average, per token)
    def _observe_recompute(self, seconds: float, tokens: int) -> None:
        timings = self.offloader.timings
        per_token = max(seconds - timings.recompute_fixed_s, 0.0) / max(tokens, 1)
        timings.recompute_per_token_s = 0.8 * timings.recompute_per_token_s + 0.2 * per_token

    def _observe_backward(self, seconds: float, tokens: int) -> None:
        timings = self.offloader.timings
        per_token = max(seconds - timings.backward_fixed_s, 0.0) / max(tokens, 1)
        timings.backward_per_token_s = 0.8 * timings.backward_per_token_s + 0.2 * per_token
