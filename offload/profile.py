"""The offloading and hedging maps for a model on a device, as JSON: keys
`offloading_map`, `hedging_map`, plus the calibrated memory model and timings the server
loads with `offload.profile`. `alchemist profile --out FILE` (bench/profile.py) writes them.

The offloading map follows the paper (§4.3.1): cached tokens and serving tokens in
500-token steps, batch in steps of 5, rounded up at lookup. The hedging map (§4.3.3)
is per layer here: for an entry of C tokens with its first n layers freed, the load or
recompute choice of each freed layer and the predicted backward time of that plan next
to "load all" and "recompute all".
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path


from offload.hedging import LOAD, RECOMPUTE, Timings, plan, simulate
from offload.memory_model import TOKEN_STEP, MemoryModel, OffloadingMap


def hedging_map(model: MemoryModel, timings: Timings, max_tokens: int, prefetch: int) -> list[dict]:
    rows = []
    num_layers = model.num_layers
    for tokens in range(TOKEN_STEP, max(max_tokens, TOKEN_STEP) + 1, TOKEN_STEP):
        layer_bytes = model.layer_bytes(tokens)
        costs = [timings.layer_costs(tokens, layer_bytes) for _ in range(num_layers)]
        for freed in range(1, num_layers + 1):
            resident = [i >= freed for i in range(num_layers)]
            choices, seconds = plan(resident, costs, timings, prefetch)
            pure = {p: simulate(["keep" if r else p for r in resident], costs, timings, prefetch) for p in (LOAD, RECOMPUTE)}
            rows.append({"cached_tokens": tokens, "freed_layers": freed, "plan": choices[:freed],
                         "predicted_s": seconds, "load_all_s": pure[LOAD], "recompute_all_s": pure[RECOMPUTE]})
    return rows


def build_profile(model: MemoryModel, timings: Timings, budget_bytes: int, max_tokens: int, max_batch: int,
                  prefetch: int, measurements: list | None = None) -> dict:
    offloading = OffloadingMap(model, budget_bytes)
    return {
        "offloading_map": {"token_step": offloading.token_step, "batch_step": offloading.batch_step,
                           "budget_bytes": budget_bytes, "rows": offloading.table(max_tokens, max_tokens, max_batch)},
        "hedging_map": {"prefetch_layers": prefetch, "rows": hedging_map(model, timings, max_tokens, prefetch)},
        "memory_model": dataclasses.asdict(model),
        "timings": dataclasses.asdict(timings),
        "measurements": [dataclasses.asdict(m) for m in measurements or []],
    }


def write_profile(profile: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile, indent=1))


def load_profile(path: str | Path, model_config=None, dtype_bytes: int | None = None) -> tuple[MemoryModel, Timings]:
    """The memory model and timings of the profile at `path`, checked: a profile of another
    model's shape (`model_config`, `dtype_bytes`: the served model's) would size every
    serving step wrong, and a speed that is not positive and finite has no plan."""
    try:
        data = json.loads(Path(path).read_text())
        memory, timings = MemoryModel(**data["memory_model"]), Timings(**data["timings"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"offload.profile {path} is not a profile written by `alchemist profile`: {err}") from None
    speeds, sizes = dataclasses.asdict(timings), dataclasses.asdict(memory)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf
               for v in (*speeds.values(), *sizes.values())) or not timings.bandwidth_bytes_per_s > 0:
        raise ValueError(f"offload.profile {path}: its sizes and timings must be numbers, finite and >= 0, its "
                         f"bandwidth positive: {sizes}, {speeds}")
    if model_config is not None:
        served = MemoryModel.analytic(model_config, dtype_bytes, memory.max_model_len)
        # a cached token's kept K/V is exact by the shapes, not fitted: a profile written
        # before it was known, or when a recording kept them twice, takes today's
        memory.kept_per_cached_token = served.kept_per_cached_token
        shape = ("num_layers", "step_per_token", "step_per_row")  # (per_token is fitted to measurements)
        if any(not math.isclose(getattr(memory, name), getattr(served, name)) for name in shape):
            raise ValueError(f"offload.profile {path} was written for another model's shape "
                             f"({[getattr(memory, name) for name in shape]} for {list(shape)}; this model's: "
                             f"{[getattr(served, name) for name in shape]}): write one for it with `alchemist profile`")
    return memory, timings
