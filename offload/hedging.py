"""Load back or recompute, per freed layer (the hedging map, done per layer).

The paper decides once for all freed layers of an entry. Here each freed layer gets its
own choice, AdaWS-style, from measured costs: backward runs from the top layer down while
reloads run on the copy stream, issued `prefetch` layers ahead of their use, so a reload
of an early layer hides behind the backward of the layers above it, and a recomputed
layer adds its forward to the compute stream instead. `simulate` is that timeline;
`plan` searches it from both pure plans and keeps only improvements, so its predicted
time is never above the better of "load all" and "recompute all".
"""

from __future__ import annotations

from dataclasses import dataclass

LOAD, RECOMPUTE, KEEP = "load", "recompute", "keep"


@dataclass
class LayerCosts:
    """Measured costs of one layer of one entry."""

    # bytes to bring back if it is loaded (None: no host copy, so it must be recomputed)
    reload_bytes: int | None
    recompute_s: float
    backward_s: float


@dataclass
class Timings:
    """The device's measured speeds (profiled at start, refined as training runs)."""

    # host -> device copy bandwidth, and the fixed cost of one layer's copies
    bandwidth_bytes_per_s: float
    copy_latency_s: float
    # one layer's forward (recompute) and backward: fixed + per token
    recompute_fixed_s: float
    recompute_per_token_s: float
    backward_fixed_s: float
    backward_per_token_s: float

    def layer_costs(self, tokens: int, reload_bytes: int | None) -> LayerCosts:
        return LayerCosts(reload_bytes, self.recompute_fixed_s + self.recompute_per_token_s * tokens,
                          self.backward_fixed_s + self.backward_per_token_s * tokens)

    def load_seconds(self, nbytes: int) -> float:
        return self.copy_latency_s + nbytes / self.bandwidth_bytes_per_s


def simulate(choices: list[str], costs: list[LayerCosts], timings: Timings, prefetch: int) -> float:
    """Predicted seconds of the backward over layers 0..L-1 (run L-1 first) for per-layer
    choices keep | load | recompute. The reload of layer i is issued when the backward of
    layer i + prefetch starts (at once for the top `prefetch` layers) and runs on one copy
    stream in order of use."""
    num = len(choices)
    start = [0.0] * num  # when each layer's backward (or recompute) starts
    copy_free = 0.0
    load_done: dict[int, float] = {}
    now = 0.0

    def issue_loads_up_to(index: int) -> None:
        nonlocal copy_free
        for j in range(num - 1, index - 1, -1):
            if choices[j] == LOAD and j not in load_done:
                issue = start[j + prefetch] if j + prefetch < num else 0.0
                copy_free = max(copy_free, issue) + timings.load_seconds(costs[j].reload_bytes)
                load_done[j] = copy_free

    for i in range(num - 1, -1, -1):
        start[i] = now
        issue_loads_up_to(max(i - prefetch, 0))
        if choices[i] == LOAD:
            now = max(now, load_done[i])
        elif choices[i] == RECOMPUTE:
            now += costs[i].recompute_s
        now += costs[i].backward_s
    return now


def plan(resident: list[bool], costs: list[LayerCosts], timings: Timings, prefetch: int) -> tuple[list[str], float]:
    """Per-layer choices for an entry whose layers are resident or freed, and the
    predicted seconds. Freed layers without a host copy are always recomputed."""
    fixed = [KEEP if r else (RECOMPUTE if c.reload_bytes is None else None) for r, c in zip(resident, costs)]
    free = [i for i, f in enumerate(fixed) if f is None]

    def with_choice(default: str) -> list[str]:
        return [f if f is not None else default for f in fixed]

    candidates = [with_choice(LOAD), with_choice(RECOMPUTE)]
    best, best_time = None, float("inf")
    for candidate in candidates:
        seconds = simulate(candidate, costs, timings, prefetch)
        if seconds < best_time:
            best, best_time = candidate, seconds
    # local search from the better pure plan: flip one freed layer at a time while it helps
    improved = True
    while improved and free:
        improved = False
        for i in free:
            trial = list(best)
            trial[i] = RECOMPUTE if trial[i] == LOAD else LOAD
            seconds = simulate(trial, costs, timings, prefetch)
            if seconds < best_time - 1e-12:
                best, best_time, improved = trial, seconds, True
    return best, best_time
