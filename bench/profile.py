"""`alchemist profile --out FILE`: measures the served model on this device and writes
the offloading and hedging maps (offload/profile.py) that `offload.profile` loads."""

from __future__ import annotations

import dataclasses

import torch

from offload.profile import build_profile, write_profile
from trainer.cache_budget import CPU_CACHE_BYTES


def run_profile(config, out: str, token_lengths: tuple[int, ...]) -> dict:
    """Measures the served model (with its LoRA adapter, as training runs it) on this
    device and writes the maps. The budget is `offload.device_budget_bytes`; if unset,
    the free device memory on CUDA, and `train.cache_bytes` on CPU."""
    from engine.llm_engine import LLMEngine
    from engine.model_loader import load
    from offload.build import calibrated_model
    from trainer.adapter import attach_lora
    from trainer.forward import recompute_segment

    model, tokenizer, name = load(config.model)
    engine = LLMEngine.for_model(model, tokenizer, config)
    attach_lora(engine.model, dataclasses.replace(config.train, mode="cpt"), True)
    lengths = tuple(t for t in token_lengths if t < config.model.max_model_len)
    print(f"profiling {name} on {engine.runner.device}: layer at {lengths} tokens, host<->device bandwidth",
          flush=True)
    memory, timings, measurements = calibrated_model(
        engine.model, config.model.max_model_len, lambda index, hidden: recompute_segment(engine.runner, index, hidden), lengths)
    budget = config.offload.device_budget_bytes
    if not budget:
        budget = torch.cuda.mem_get_info(engine.runner.device)[0] if engine.runner.device.type == "cuda" \
            else config.train.cache_bytes or CPU_CACHE_BYTES
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
