"""`alchemist profile --out FILE`: the offloading and hedging maps for this model on this
device, as JSON (keys `offloading_map`, `hedging_map`, plus the calibrated memory model
and timings the server loads with `offload.profile`).

The offloading map follows the paper (§4.3.1): cached tokens and serving tokens in
500-token steps, batch in steps of 5, rounded up at lookup. The hedging map (§4.3.3)
is per layer here: for an entry of C tokens with its first n layers freed, the load or
recompute choice of each freed layer and the predicted backward time of that plan next
to "load all" and "recompute all".
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

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


def load_profile(path: str | Path) -> tuple[MemoryModel, Timings]:
    data = json.loads(Path(path).read_text())
    try:
        return MemoryModel(**data["memory_model"]), Timings(**data["timings"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a profile written by `alchemist profile`: {err}") from err


def run_profile(config, out: str, token_lengths: tuple[int, ...]) -> dict:
    """Measures the served model (with its LoRA adapter, as training runs it) on this
    device and writes the maps. The budget is `offload.device_budget_bytes`; if unset,
    the free device memory on CUDA, and `train.cache_bytes` on CPU."""
    from engine.llm_engine import LLMEngine
    from engine.model_loader import load_model
    from offload.build import calibrated_model
    from trainer.adapter import attach_lora
    from trainer.forward import recompute_segment

    model, tokenizer, name = load_model(config.model.model, config.model.dtype, config.model.device)
    engine = LLMEngine(model, tokenizer, config)
    attach_lora(engine.model, dataclasses.replace(config.train, mode="cpt"), True)
    lengths = tuple(t for t in token_lengths if t < config.model.max_model_len)
    print(f"profiling {name} on {engine.runner.device}: layer at {lengths} tokens, host<->device bandwidth",
          flush=True)
    memory, timings, measurements = calibrated_model(
        engine.model, config, lambda index, hidden: recompute_segment(engine.runner, index, hidden), lengths)
    budget = config.offload.device_budget_bytes
    if not budget:
        budget = torch.cuda.mem_get_info(engine.runner.device)[0] if engine.runner.device.type == "cuda" \
            else config.train.cache_bytes
    profile = build_profile(memory, timings, budget, config.model.max_model_len, config.scheduler.max_num_seqs,
                            config.offload.prefetch_layers, measurements)
    profile["model"], profile["device"] = name, str(engine.runner.device)
    write_profile(profile, out)
    for m in measurements:
        print(f"  {m.tokens:5d} tokens: {m.saved_bytes / 2**20:7.2f} MiB saved per layer, recompute "
              f"{m.recompute_s * 1e3:6.1f} ms, backward {m.backward_s * 1e3:6.1f} ms", flush=True)
    print(f"  host->device {timings.bandwidth_bytes_per_s / 1e9:.2f} GB/s; memory model x{memory.calibration:.2f} "
          f"of analytic; wrote {out} ({len(profile['offloading_map']['rows'])} offloading rows, "
          f"{len(profile['hedging_map']['rows'])} hedging rows)", flush=True)
    return profile
