"""`alchemist bench training --mode grpo`: the shared-prefix schedule on the served
recording against the dense GRPO trainer, side by side.

Each round serves one request of G samples (temperature 1, exactly R tokens each) on a
fresh P-token prompt, recorded as serving records it (one prefill, the samples forking
its KV blocks), gives each sample a distinct reward, then trains on the group three ways
in rotating order, from the same adapter:
  - reuse: the samples' suffixes forwarded against the recorded prompt K/V and
    back-propagated one at a time, the prompt's backward once (trainer/grpo.py); the
    prompt's forward was serving's;
  - batched: TRL's GRPOTrainer's way, the G rows `prompt + response` in one batch;
  - one row: the same rows one at a time (the prompt forward and backward G times).
The speedup is against the faster baseline; the memory ratio is reuse's peak activation
bytes (the recording included) over the batched baseline's, both measured by counting
what autograd saves. LoRA gradients of the three are compared.
"""

from __future__ import annotations

import json
import random
import statistics
import time

from bench.report import pyplot, rel_diff, save_figure, write_json
from bench.traces import synthetic_tokens
from bench.training import Bench
from engine.recording import SavedTensorTracker
from engine.sampling_params import SamplingParams
from server.config import AlchemistConfig
from trainer.entries import EntryState, GroupEntry, GroupRewards

PATHS = ("reuse", "batched", "one_row")


def serve_group(bench: Bench, prompt: list[int], group: int, response_tokens: int, request_id: str,
                tracker: SavedTensorTracker | None, seed: int | None = None) -> GroupEntry:
    """Serves one recorded request of `group` samples; returns its entry, rewarded. The
    samples and rewards follow `seed` (by default, the request id)."""
    bench.engine.runner.record_tracker = tracker
    params = SamplingParams(n=group, temperature=1.0, seed=len(request_id) if seed is None else seed,
                            max_tokens=response_tokens, min_tokens=response_tokens)
    bench.engine.add_request(request_id, prompt, params, train=True)
    while bench.engine.has_unfinished():
        bench.engine.step()
    bench.engine.runner.record_tracker = None
    entry = bench.trainer.cache.get(request_id)
    # distinct: every sample has an advantage
    rewards = random.Random(request_id if seed is None else seed).sample(range(1000), group)
    bench.trainer.cache.attach_label(entry, GroupRewards([float(r) for r in rewards]))
    return entry


def tokens_only(bench: Bench, entry: GroupEntry) -> GroupEntry:
    """The dense trainer's copy of a group: its tokens, served log-probs and rewards."""
    copy = bench.method.make_label_entry(entry.completion_id + "-tokens", entry.prompt_token_ids,
                                         entry.adapter_version)
    copy.responses, copy.served_token_logps = dict(entry.responses), dict(entry.served_token_logps)
    copy.logprob_temperature = entry.logprob_temperature
    copy.label = entry.label
    return copy


def _paths(bench: Bench, prompt: list[int], group: int, response_tokens: int, r: int,
           trackers: dict[str, SavedTensorTracker] | None) -> dict:
    """Serves `prompt` recorded (a group of `group` samples) and trains on it the three
    ways, in rotating order; with `trackers` (one per path), what each saves is counted,
    the recording's by the reuse path's. -> {path: run_job's result}."""
    method = bench.method
    entry = serve_group(bench, prompt, group, response_tokens, f"grpo-{r}-{time.monotonic_ns()}",
                        trackers["reuse"] if trackers else None, seed=r)
    results = {}
    for path in PATHS[r % 3:] + PATHS[:r % 3]:
        tracker = trackers[path] if trackers else None
        if path == "reuse":
            results[path] = bench.run_job(method.reuse_job(entry, bench.context), tracker)
            bench.trainer.cache.end(entry, EntryState.TRAINED)
        else:  # a copy each: each path computes the KL term's reference itself
            method.recompute_rows = 1 if path == "one_row" else group
            results[path] = bench.run_job(method.baseline_job(tokens_only(bench, entry), bench.context), tracker)
    method.recompute_rows = None
    return results


def measure(bench: Bench, group: int, prompt_tokens: int, response_tokens: int, repeats: int) -> dict:
    """Each round trains twice on the same group: timed as the server runs (no counting
    hooks), then with a tracker per path, for the saved bytes and the gradients."""
    rows = []
    for r in range(repeats + 1):  # round 0 warms up and is not reported
        if r == 0:
            print(f"  grpo G={group} P={prompt_tokens} R={response_tokens}: a warm-up round first (not reported)",
                  flush=True)
        prompt = synthetic_tokens(bench.tokenizer, prompt_tokens, r)
        timed = _paths(bench, prompt, group, response_tokens, r, None)
        trackers = {path: SavedTensorTracker() for path in PATHS}
        results = _paths(bench, prompt, group, response_tokens, r, trackers)
        if r == 0:
            continue
        rows.append({**{f"{p}_s": timed[p][0] for p in PATHS},
                     **{f"{p}_peak_bytes": trackers[p].peak_bytes for p in PATHS},
                     **{f"{p}_max_slice_s": timed[p][2] for p in PATHS},
                     # both passes (with the trackers' hooks and without), both paths against batched
                     "grad_rel_diff": max(rel_diff(run[path][1], run["batched"][1])
                                          for run in (results, timed) for path in ("reuse", "one_row"))})
        row = rows[-1]
        print(f"  grpo G={group} P={prompt_tokens} R={response_tokens} round {r}/{repeats}: reuse {row['reuse_s']:.2f}s"
              f"  batched {row['batched_s']:.2f}s  one row {row['one_row_s']:.2f}s  memory "
              f"{row['reuse_peak_bytes'] / 2**20:.0f} / {row['batched_peak_bytes'] / 2**20:.0f} / "
              f"{row['one_row_peak_bytes'] / 2**20:.0f} MiB", flush=True)
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0] if key != "grad_rel_diff"}
    baseline = min(median["batched_s"], median["one_row_s"])
    trained = prompt_tokens + group * response_tokens
    return {
        "mode": "grpo", "group_size": group, "prompt_tokens": prompt_tokens, "response_tokens": response_tokens,
        "prefix_ratio": round(prompt_tokens / (prompt_tokens + response_tokens), 3), "repeats": repeats,
        "reuse_tokens_per_s": round(trained / median["reuse_s"], 2),
        "baseline_tokens_per_s": round(trained / baseline, 2),
        "baseline": "batched" if median["batched_s"] <= median["one_row_s"] else "one_row",
        "speedup": round(baseline / median["reuse_s"], 3),
        "speedup_over_batched": round(median["batched_s"] / median["reuse_s"], 3),
        "speedup_over_one_row": round(median["one_row_s"] / median["reuse_s"], 3),
        "reuse_peak_activation_bytes": int(median["reuse_peak_bytes"]),
        "baseline_peak_activation_bytes": int(median["batched_peak_bytes"]),
        "one_row_peak_activation_bytes": int(median["one_row_peak_bytes"]),
        "memory_ratio": round(median["reuse_peak_bytes"] / median["batched_peak_bytes"], 3),
        "memory_ratio_over_one_row": round(median["reuse_peak_bytes"] / median["one_row_peak_bytes"], 3),
        "max_grad_rel_diff": max(row["grad_rel_diff"] for row in rows),
        "reuse_max_slice_s": round(max(row["reuse_max_slice_s"] for row in rows), 4),
        "rounds": rows,
    }


def plot_sweep(results: list[dict], x_key: str, x_label: str, path_prefix: str) -> list[str]:
    """Speedup and peak memory against the swept quantity (cf. the paper's figures)."""
    plt = pyplot()
    xs = [r[x_key] for r in results]
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [r["speedup_over_batched"] for r in results], "o-", label="over batched (TRL)", color="tab:red")
    ax.plot(xs, [r["speedup_over_one_row"] for r in results], "s-", label="over one row at a time",
            color="tab:orange")
    for x, r in zip(xs, results):
        ax.annotate(f"{r['speedup']:.1f}x", (x, r["speedup"]), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=9)
    ax.axhline(1.0, color="grey", lw=0.8)
    paths.append(save_figure(fig, ax, x_label, "training speedup of the shared-prefix reuse",
                             "GRPO on the served recording vs the dense trainer", f"{path_prefix}-speedup.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, style, color in (("reuse_peak_activation_bytes", "reuse (recording included)", "o-", "tab:blue"),
                                     ("baseline_peak_activation_bytes", "batched (TRL)", "s-", "tab:red"),
                                     ("one_row_peak_activation_bytes", "one row at a time", "^-", "tab:orange")):
        ax.plot(xs, [r[key] / 2**20 for r in results], style, label=label, color=color)
    paths.append(save_figure(fig, ax, x_label, "peak activation memory (MiB, measured)",
                             "GRPO peak activation memory", f"{path_prefix}-memory.png"))
    return paths


def run_grpo_training_bench(config: AlchemistConfig, group: int, prompt_tokens: int, response_tokens: int,
                            repeats: int = 2, json_path: str | None = None, sweep_group: list[int] | None = None,
                            sweep_prompt: list[int] | None = None, plot_prefix: str | None = None) -> dict:
    longest = max([prompt_tokens, *(sweep_prompt or [])]) + response_tokens
    bench = Bench(config, "grpo", longest)
    summary: dict = {"model": bench.name, "lora_rank": bench.trainer.config.lora_rank,
                     "result": measure(bench, group, prompt_tokens, response_tokens, repeats)}
    prefix = plot_prefix or "bench-training-grpo"
    plots = []
    if sweep_group:
        summary["sweep_group"] = [summary["result"] if g == group else
                                  measure(bench, g, prompt_tokens, response_tokens, repeats) for g in sweep_group]
        plots += plot_sweep(summary["sweep_group"], "group_size", f"group size (P = {prompt_tokens}, "
                            f"R = {response_tokens})", f"{prefix}-group")
    if sweep_prompt:
        summary["sweep_prompt"] = [summary["result"] if p == prompt_tokens else
                                   measure(bench, group, p, response_tokens, repeats) for p in sweep_prompt]
        plots += plot_sweep(summary["sweep_prompt"], "prefix_ratio", f"prefix ratio P / (P + R) (G = {group}, "
                            f"R = {response_tokens})", f"{prefix}-prefix")
    if plots:
        summary["plots"] = plots
    print(json.dumps({k: v for k, v in summary["result"].items() if k != "rounds"}))
    write_json({**summary, **{k: v for k, v in summary["result"].items()}}, json_path)
    return summary
