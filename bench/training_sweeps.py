"""`alchemist bench training --mode dpo|grpo --one-vs-two-sweeps`: the suffixes' and the
prompt's backward in one top-down sweep against two, side by side.

Each round serves one prompt once per schedule, recorded each time (the same tokens:
greedy for DPO, one seed for a GRPO group), labels the entries alike, then trains each
under its schedule, in rotating order, from the same adapter: `one_backward_sweep` on,
off, and for GRPO the group in micro-batches of MICRO_BATCH_SAMPLES, each with its own
sweep before the prompt's (the schedule that holding every micro-batch's gK/gV for one
sweep would replace). Per job: seconds, the LoRA gradients (compared), and the activation
bytes autograd holds — the recording and the job's own saved tensors — read after every
slice: their peak, and their mean over the job's time. On a GPU, the allocator's peak too.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench.report import rel_diff, write_json
from bench.traces import synthetic_tokens
from bench.training import Bench
from bench.training_grpo import serve_group
from engine.recording import SavedTensorTracker
from server.config import AlchemistConfig
from trainer.entries import EntryState

SCHEDULES = ("one_sweep", "two_sweeps")
# GRPO also: the group in micro-batches of this many samples, each with its own sweep
# before the prompt's (what holding every micro-batch's gK/gV for one sweep would replace)
MICRO_BATCH_SAMPLES = 2


def _run(bench: Bench, entry, tracker: SavedTensorTracker, schedule: str) -> dict:
    """Runs `entry`'s reuse job slice by slice under `schedule`."""
    context = bench.context
    context.one_backward_sweep = schedule == "one_sweep"
    token_bound = getattr(bench.method, "recompute_tokens", None)
    if schedule == "micro_batches":
        bench.method.recompute_tokens = MICRO_BATCH_SAMPLES * max(map(len, entry.responses.values()))
    cuda = bench.engine.runner.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    slices = []
    seconds, grads, _ = bench.run_job(bench.method.reuse_job(entry, context), tracker, slices=slices)
    byte_seconds = sum(took * live for took, live, _ in slices)  # held through each slice from its start
    peak = max([tracker.peak_bytes] + [max(before, after) for _, before, after in slices])
    result = {"seconds": seconds, "peak_bytes": peak, "mean_bytes": byte_seconds / max(seconds, 1e-9), "grads": grads}
    if cuda:
        result["device_peak_bytes"] = torch.cuda.max_memory_allocated()
    if schedule == "micro_batches":
        bench.method.recompute_tokens = token_bound
    bench.trainer.cache.end(entry, EntryState.TRAINED)
    return result


def measure_sweeps(bench: Bench, mode: str, tokens: int, repeats: int, group: int, response_tokens: int) -> dict:
    """One sweep against two on fresh entries of `tokens` trained tokens (DPO: half prompt,
    a quarter each response; GRPO: the prompt, `group` samples of `response_tokens`)."""
    prompt_len = tokens // 2 if mode == "dpo" else tokens
    rows = []
    for r in range(repeats + 1):  # round 0 warms up and is not reported
        prompt = synthetic_tokens(bench.tokenizer, prompt_len, r)
        results = {}
        schedules = SCHEDULES + (("micro_batches",) if mode == "grpo" else ())
        for i, schedule in enumerate(schedules[r % len(schedules):] + schedules[:r % len(schedules)]):
            tracker = SavedTensorTracker()
            request_id = f"sweeps-{r}-{i}-{time.monotonic_ns()}"
            if mode == "dpo":
                chosen = synthetic_tokens(bench.tokenizer, tokens // 4 - 1, r + 50) + [bench.tokenizer.eos_token_id]
                bench.given_responses = True
                entry, _ = bench.entry(prompt, r, chosen, tokens // 4, tracker)
            else:
                entry = serve_group(bench, prompt, group, response_tokens, request_id, tracker, seed=1000 + r)
            results[schedule] = _run(bench, entry, tracker, schedule)
        if r == 0:
            continue
        two = results["two_sweeps"]
        rows.append({**{f"{s}_{k}": results[s][k] for s in schedules for k in results[s] if k != "grads"},
                     "grad_rel_diff": max(rel_diff(results[s]["grads"], two["grads"]) for s in schedules)})
        print(f"  {mode} {tokens} tokens round {r}/{repeats}: " + "; ".join(
            f"{s} {results[s]['seconds']:.3f}s, activations peak {results[s]['peak_bytes'] / 2**20:.0f} MiB, "
            f"mean {results[s]['mean_bytes'] / 2**20:.0f} MiB" for s in schedules), flush=True)
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    return {
        "mode": mode, "tokens": tokens, "repeats": repeats,
        **({"group_size": group, "response_tokens": response_tokens} if mode == "grpo" else {}),
        "time_two_over_one": round(median["two_sweeps_seconds"] / median["one_sweep_seconds"], 3),
        "peak_one_over_two": round(median["one_sweep_peak_bytes"] / median["two_sweeps_peak_bytes"], 3),
        "mean_one_over_two": round(median["one_sweep_mean_bytes"] / median["two_sweeps_mean_bytes"], 3),
        **({"device_peak_one_over_two": round(median["one_sweep_device_peak_bytes"]
                                              / median["two_sweeps_device_peak_bytes"], 3)}
           if "one_sweep_device_peak_bytes" in median else {}),
        **({f"micro_batches_of_{MICRO_BATCH_SAMPLES}_{key}": value for key, value in {
            "time_over_one_sweep": round(median["micro_batches_seconds"] / median["one_sweep_seconds"], 3),
            "peak_over_one_sweep": round(median["micro_batches_peak_bytes"] / median["one_sweep_peak_bytes"], 3),
        }.items()} if mode == "grpo" else {}),
        "max_grad_rel_diff": max(row["grad_rel_diff"] for row in rows),
        "rounds": rows,
    }


def run_sweeps_bench(config: AlchemistConfig, mode: str, tokens: int, repeats: int, group: int,
                     response_tokens: int, json_path: str | None) -> dict:
    if mode not in ("dpo", "grpo"):
        raise SystemExit("--one-vs-two-sweeps compares a DPO or GRPO job's schedules (--mode dpo or grpo)")
    bench = Bench(config, mode, tokens if mode == "dpo" else tokens + group * response_tokens)
    result = measure_sweeps(bench, mode, tokens, repeats, group, response_tokens)
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))
    write_json({"model": bench.name, "dtype": str(next(bench.engine.model.parameters()).dtype),
                "torch_threads": torch.get_num_threads(), **result}, json_path)
    return result
