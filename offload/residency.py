"""Brings one recording's freed layers back for its backward, top layer first.

On the first layer it plans, per freed layer, load or recompute (offload/hedging.py);
before each layer's backward it issues the reloads of the next planned-load layers
(`prefetch_layers` ahead, in the order backward needs them, within the device budget)
and waits for or recomputes the layer itself; after it, it releases the layer. The
costs it measures (recompute and backward per token) refine the planner's timings.
"""

from __future__ import annotations

import time

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
        self._backward_started = 0.0
        self._backward_rows = 0
        placement.active = True

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
            started = time.perf_counter()
            num = self.placement.num_tokens
            segment = self.offloader.recompute(index, layer.segment.leaf[:, :num])
            self.offloader.stats.recomputed_layers += 1
            self._observe_recompute(time.perf_counter() - started)
        self._backward_started = time.perf_counter()
        self._backward_rows = segment.out.shape[1]  # a kept layer's hold the riding decodes' rows too
        return segment

    def after(self, index: int) -> None:
        self._observe_backward(time.perf_counter() - self._backward_started)
        self.offloader.release_layer(self.placement.layers[index])
        if index == 0:
            self.placement.active = False

    # measured costs refine the planner's timings (exponential average, per token)
    def _observe_recompute(self, seconds: float) -> None:
        timings, num = self.offloader.timings, max(self.placement.num_tokens, 1)
        per_token = max(seconds - timings.recompute_fixed_s, 0.0) / num
        timings.recompute_per_token_s = 0.8 * timings.recompute_per_token_s + 0.2 * per_token

    def _observe_backward(self, seconds: float) -> None:
        timings, num = self.offloader.timings, max(self._backward_rows, 1)
        per_token = max(seconds - timings.backward_fixed_s, 0.0) / num
        timings.backward_per_token_s = 0.8 * timings.backward_per_token_s + 0.2 * per_token
