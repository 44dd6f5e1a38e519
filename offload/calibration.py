"""Measures, on the actual device and model, what the offloader's decisions rest on: bytes
a recorded layer saves per token count (calibrating the memory model), host-to-device
bandwidth, and one layer's recompute and backward times. Run at start (short) and by
`alchemist profile` (longer, written to a file)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.recording import SavedTensorTracker
from offload.hedging import Timings
from offload.host_pool import HostPool
from offload.copy_stream import CopyStream


@dataclass
class LayerMeasurement:
    tokens: int
    saved_bytes: int
    recompute_s: float
    backward_s: float


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_layer(recompute, index: int, tokens: int, hidden_size: int, device: torch.device, dtype: torch.dtype,
                  repeats: int = 2) -> LayerMeasurement:
    """One layer's saved bytes, forward (recompute) and backward seconds at `tokens`
    (the best of `repeats`)."""
    best_fwd = best_bwd = float("inf")
    saved = 0
    generator = torch.Generator(device="cpu").manual_seed(tokens)
    hidden = torch.randn(1, tokens, hidden_size, generator=generator).to(device=device, dtype=dtype)
    for _ in range(repeats):
        tracker = SavedTensorTracker()
        _synchronize(device)
        started = time.perf_counter()
        with tracker.hooks():
            segment = recompute(index, hidden)
        _synchronize(device)
        forward = time.perf_counter() - started
        saved = tracker.live_bytes
        started = time.perf_counter()
        torch.autograd.backward([segment.out], [torch.ones_like(segment.out)])
        _synchronize(device)
        best_fwd, best_bwd = min(best_fwd, forward), min(best_bwd, time.perf_counter() - started)
        del segment
    return LayerMeasurement(tokens, saved, best_fwd, best_bwd)


def measure_bandwidth(device: torch.device, nbytes: int = 32 << 20, repeats: int = 3) -> tuple[float, float]:
    """(host -> device bytes per second through the copy stream, fixed seconds per copy)."""
    pool = HostPool(nbytes, pin=device.type == "cuda")
    copies = CopyStream(device)
    try:
        block = pool.allocate(nbytes)
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        small = torch.empty(4096, dtype=torch.uint8, device=device)
        large_s = small_s = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            copies.copy(target, block.data).wait()
            large_s = min(large_s, time.perf_counter() - started)
            started = time.perf_counter()
            copies.copy(small, block.data[:4096]).wait()
            small_s = min(small_s, time.perf_counter() - started)
        return nbytes / max(large_s - small_s, 1e-9), small_s
    finally:
        copies.close()


def fit_linear(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed, per token) through the first and last of (tokens, seconds), the per-token
    cost at least half the longer's average: a layer's time grows with its tokens, and a
    busy machine's noise (the longer measured no slower, or hardly) read as a cost of
    0 us per token would have the offloader recompute long recordings as if they were short."""
    (t1, s1), (t2, s2) = points[0], points[-1]
    if t2 == t1:
        return 0.0, s1 / t1
    per_token = max((s2 - s1) / (t2 - t1), s2 / t2 / 2)
    return max(s1 - per_token * t1, 0.0), per_token


def calibrate(recompute, hidden_size: int, device: torch.device, dtype: torch.dtype,
              token_lengths: tuple[int, ...] = (64, 256), layer: int = 0) -> tuple[Timings, list[LayerMeasurement]]:
    measurements = [measure_layer(recompute, layer, t, hidden_size, device, dtype) for t in token_lengths]
    bandwidth, latency = measure_bandwidth(device)
    recompute_fixed, recompute_per_token = fit_linear([(m.tokens, m.recompute_s) for m in measurements])
    backward_fixed, backward_per_token = fit_linear([(m.tokens, m.backward_s) for m in measurements])
    timings = Timings(bandwidth, latency, recompute_fixed, recompute_per_token, backward_fixed, backward_per_token)
    return timings, measurements
