"""`alchemist bench offload`: the same recorded entries trained with every layer kept on
the device, and under a device budget smaller than their activations with the freed
layers loaded back (offload), recomputed (recompute), or each decided by the hedging
plan (hedged) — side by side in one run, on the embedded model (CPT).

Each round records the entries afresh for every policy (the adapter does not change:
gradients are compared, no optimizer step is taken), frees layers as the offloader does
before a serving step (newest entry first, layer 0 first), then times each entry's
backward — reloads and recomputes included — and compares its LoRA gradients with those
of keeping everything. `--sweep` frees a fixed fraction of every entry's layers instead
and draws throughput relative to keeping everything against that fraction (the paper's
offloading figure).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from server.config import AlchemistConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import run_to_end
from trainer.adapter import lora_gradients
from bench.report import pyplot, rel_diff, synchronized_clock, write_json
from bench.training import Bench
from bench.traces import synthetic_tokens
from trainer.entries import EntryState

POLICIES = {"keep": None, "offload": "load", "recompute": "recompute", "hedged": "hedged"}


class _OffloadBench(Bench):
    def __init__(self, config: AlchemistConfig, tokens: int):
        offload = dataclasses.replace(config.offload, device_budget_bytes=1 << 50,
                                      host_budget_bytes=max(config.offload.host_budget_bytes, 4 << 30))
        super().__init__(dataclasses.replace(config, offload=offload), "cpt", tokens)
        self.offloader = self.trainer.offloader
        self.base_config = offload

    def round(self, prompts: list[list[int]], policy: str, free) -> list[dict]:
        """Records `prompts`, frees layers with `free(offloader, placements)` (not for
        keep), and trains each entry; per entry: seconds, gradients and offloader counts."""
        offloader = self.offloader
        offloader.config = dataclasses.replace(self.base_config, policy=POLICIES[policy] or "load")
        entries = []
        for i, prompt in enumerate(prompts):
            request_id = f"offload-{policy}-{i}-{time.monotonic_ns()}"
            self.serve(prompt, True, request_id)
            entries.append(self.trainer.cache.get(request_id))
        cached = offloader.device_bytes
        started = synchronized_clock()  # freeing runs before a serving step (it copies to the host at freeing time)
        if POLICIES[policy] is not None:
            free(offloader, [e.recording.placement for e in entries], cached)
        free_seconds = synchronized_clock() - started
        offloader.stats.peak_device_bytes = offloader.device_bytes
        rows = []
        for entry in entries:
            before = dataclasses.replace(offloader.stats)
            self.trainer.optimizer.zero_grad()
            started = synchronized_clock()
            run_to_end(self.method.reuse_job(entry, self.context))
            seconds = synchronized_clock() - started
            grads = lora_gradients(self.trainer.peft_model)
            self.trainer.optimizer.zero_grad()
            self.trainer.cache.end(entry, EntryState.TRAINED)
            stats = offloader.stats
            rows.append({"seconds": seconds, "grads": grads, "tokens": len(entry.prompt_token_ids),
                         "cached_bytes": cached,
                         "reloaded": stats.reloaded_layers - before.reloaded_layers,
                         "recomputed": stats.recomputed_layers - before.recomputed_layers,
                         "reload_wait_s": stats.reload_wait_seconds - before.reload_wait_seconds})
        rows[-1]["peak_device_bytes"] = offloader.stats.peak_device_bytes
        rows[0]["free_s"] = free_seconds
        offloader.config = self.base_config
        return rows


def recording_cost(bench: _OffloadBench, prompts: list[list[int]], repeats: int, copy_to_host: str) -> float:
    """A recorded prefill with the offloader taking its segments over one without, median
    of alternating pairs; copy_to_host "recording" copies each to the host pool as it comes."""
    engine, ratios = bench.engine, []
    # the same runner and hooks, but no offloader taking the recorded segments (run one at
    # a time, the two engines never hold KV blocks at once)
    plain = LLMEngine(engine.runner, engine.tokenizer, engine.config, dataclasses.replace(engine.hooks,
                                                                                          segment_sink=None))
    bench.offloader.config = dataclasses.replace(bench.base_config, copy_to_host=copy_to_host)
    for r in range(repeats + 1):
        seconds = {}
        for with_offloader in ((True, False) if r % 2 else (False, True)):
            request_id = f"record-{with_offloader}-{r}-{time.monotonic_ns()}"
            seconds[with_offloader] = bench.serve(prompts[r % len(prompts)], True, request_id,
                                                  engine=engine if with_offloader else plain)
            bench.trainer.cache.end(bench.trainer.cache.get(request_id), EntryState.DROPPED)
        if r:
            ratios.append(seconds[True] / seconds[False])
    bench.offloader.config = bench.base_config
    return round(statistics.median(ratios), 3)


def free_to_budget(fraction: float):
    """Frees as before a serving step, to `fraction` of the cached bytes; the budget then
    also bounds the reloads during training."""
    def free(offloader, placements, cached):
        budget = int(cached * fraction)
        offloader.config = dataclasses.replace(offloader.config, device_budget_bytes=budget)
        offloader.free_to(budget)
    return free


def free_fraction(fraction: float):
    """Frees the first `fraction` of every entry's layers."""
    def free(offloader, placements, cached):
        for placement in placements:
            for layer in placement.layers[:round(fraction * len(placement.layers))]:
                offloader.free_layer(placement, layer)
    return free


def _summarize(rounds: dict[str, list[list[dict]]], reference: str = "keep") -> dict:
    out = {}
    for policy, per_round in rounds.items():
        rows = [row for r in per_round for row in r]
        seconds = statistics.median(sum(row["seconds"] for row in r) for r in per_round)
        tokens = sum(row["tokens"] for row in per_round[0])
        diffs = [rel_diff(row["grads"], ref["grads"])
                 for r, ref_round in zip(per_round, rounds[reference]) for row, ref in zip(r, ref_round)]
        out[policy] = {"tokens_per_s": round(tokens / seconds, 2), "max_grad_rel_diff": max(diffs),
                       "reloaded_layers": sum(row["reloaded"] for row in rows) // len(per_round),
                       "recomputed_layers": sum(row["recomputed"] for row in rows) // len(per_round),
                       "reload_wait_fraction": round(sum(row["reload_wait_s"] for row in rows)
                                                     / sum(row["seconds"] for row in rows), 4),
                       "peak_device_bytes": max(r[-1]["peak_device_bytes"] for r in per_round),
                       # freeing's seconds (not in the training time above) over the training's
                       "freeing_over_training": round(statistics.median(r[0]["free_s"] for r in per_round) / seconds,
                                                      4)}
    for policy in out:
        out[policy]["relative_to_keep"] = round(out[policy]["tokens_per_s"] / out[reference]["tokens_per_s"], 3)
    return out


def _measure(bench: _OffloadBench, prompts, free, repeats: int) -> dict:
    rounds: dict[str, list] = {p: [] for p in POLICIES}
    for r in range(repeats + 1):  # round 0 warms up
        order = list(POLICIES) if r % 2 else list(reversed(POLICIES))
        for policy in order:
            rows = bench.round(prompts, policy, free)
            if r:
                rounds[policy].append(rows)
    return _summarize(rounds)


def plot_sweep(rows: list[dict], path: str) -> str:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    fractions = [row["offloaded_fraction"] for row in rows]
    for policy, style in (("offload", "o-"), ("recompute", "s-"), ("hedged", "^-")):
        ax.plot(fractions, [row["policies"][policy]["relative_to_keep"] for row in rows], style, label=policy)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("fraction of each entry's layers freed from the device")
    ax.set_ylabel("training throughput / all kept")
    ax.set_title("Freed layers loaded back, recomputed, or hedged per layer (cf. paper Fig. 9)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_offload_bench(config: AlchemistConfig | None = None, tokens: int = 512, entries: int = 3,
                      repeats: int = 2, budget_fraction: float = 0.5, json_path: str | None = None,
                      sweep: bool = False, fractions: tuple[float, ...] | None = None,
                      plot_path: str | None = None, device: str | None = None) -> dict:
    config = config or AlchemistConfig()
    if device is not None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, device=device))
    bench = _OffloadBench(config, tokens)
    prompts = [synthetic_tokens(bench.tokenizer, tokens, i) for i in range(entries)]
    report = {"model": bench.name, "device": str(bench.engine.runner.device), "tokens": tokens,
              "entries": entries, "repeats": repeats, "torch_threads": torch.get_num_threads(),
              "timings": dataclasses.asdict(bench.offloader.timings)}
    print(f"offload bench: {entries} entries x {tokens} tokens, budget {budget_fraction:.0%} of their activations",
          flush=True)
    policies = _measure(bench, prompts, free_to_budget(budget_fraction), repeats)
    report["policies"] = policies
    report["recording_overhead_with_offloader"] = {
        mode: recording_cost(bench, prompts, max(repeats, 3), mode) for mode in ("recording", "freeing")}
    print("  recorded prefill with the offloader / without: " + ", ".join(
        f"copy_to_host={mode} x{ratio:.3f}" for mode, ratio in report["recording_overhead_with_offloader"].items()),
        flush=True)
    report["budget_fraction"] = budget_fraction
    report["peak_device_activation_bytes"] = max(policies[p]["peak_device_bytes"] for p in policies if p != "keep")
    report["cached_activation_bytes"] = policies["keep"]["peak_device_bytes"]
    report["budget_bytes"] = int(report["cached_activation_bytes"] * budget_fraction)
    for policy, result in policies.items():
        print(f"  {policy:9s} {result['tokens_per_s']:8.1f} tok/s  x{result['relative_to_keep']:.3f}  "
              f"grad diff {result['max_grad_rel_diff']:.1e}  reloaded {result['reloaded_layers']}  "
              f"recomputed {result['recomputed_layers']}  wait {result['reload_wait_fraction']:.1%}  "
              f"freeing {result['freeing_over_training']:.1%} of the training's time", flush=True)
    if sweep or fractions:
        rows = []
        for fraction in fractions or (0.0, 0.25, 0.5, 0.75, 1.0):
            result = _measure(bench, prompts, free_fraction(fraction), repeats)
            rows.append({"offloaded_fraction": fraction, "policies": result})
            print(f"  sweep {fraction:.2f}: " + "  ".join(f"{p} x{r['relative_to_keep']:.3f}"
                                                        for p, r in result.items() if p != "keep"), flush=True)
        report["sweep"] = rows
        if sweep:
            report["plot"] = plot_sweep(rows, plot_path or "bench-offload.png")
    write_json(report, json_path)
    return report
