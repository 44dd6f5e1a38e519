"""`alchemist bench training`: the reuse path against the recompute path, side by side.

On the embedded model, each round serves a fresh prompt through the engine twice — once
plainly and once recorded (their ratio is the recording overhead) — then trains on the
recorded entry both ways, in alternating order: reuse (backward from the recorded
prefill; DPO: responses against the recorded prompt K/V) and recompute, the separate
trainer (the method's `baseline_job`: full forward from tokens, then backward; DPO:
`[prompt+chosen; prompt+rejected]` as TRL does). Both
start from the same adapter and the same entry; their LoRA gradients are compared.
Peak activation memory is measured by counting the bytes autograd really saves
(engine/recording.py), including, for the reuse path, the recorded prefill it holds —
in a second recording and training of the same prompt each round: the counting hooks
cost host time (a GPU's, on a launch-bound job), so the times are taken without them,
as the server runs.

Tokens: N trained tokens in all (CPT: an N-token prompt; DPO: N/2 prompt and N/4 for
each response). Text is synthetic: a fixed English passage, cut to length. DPO follows
the paper's evaluation: the served response (N/4 tokens, decoded by the engine) is the
rejected one, and a given text of N/4 tokens the chosen one. Each DPO job computes its
reference log-probs itself, as the trainer's do: with `--dpo-reference base` a forward of
the base model, with `served` none (the reference is the version that served the prompt).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import statistics
import time

import torch

from bench.report import pyplot, rel_diff, save_figure, synchronized_clock, write_json, write_profile
from bench.traces import synthetic_tokens
from engine.model_loader import load
from engine.model_runner import run_to_end
from engine.recording import SavedTensorTracker
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from server.build import build_training_engine
from server.config import AlchemistConfig
from trainer.adapter import lora_gradients, lora_parameters
from trainer.entries import EntryState, PreferenceLabel

logger = logging.getLogger(__name__)


class Bench:
    def __init__(self, config: AlchemistConfig, mode: str, max_tokens: int):
        model, self.tokenizer, self.name = load(config.model)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, max_model_len=max_tokens + 64),
                                     scheduler=dataclasses.replace(config.scheduler,
                                                                   max_num_batched_tokens=max(max_tokens + 64, 2048)))
        # the config's training settings (a --config file's lora_compute_dtype, say), with
        # every prefill recorded, a cache that holds them all, and no reward function or gate
        train = dataclasses.replace(config.train, mode=mode, cache_bytes=1 << 40, max_record_tokens=max_tokens + 64,
                                    record_fraction=1.0, reward_function="", eval_set="")
        self.engine, self.trainer = build_training_engine(model, self.tokenizer, config, train,
                                                          offload=config.offload)
        # B starts at zero in LoRA, which makes A's gradient zero; a small random B gives
        # every LoRA tensor a gradient to compare, and keeps the model near the base
        with torch.no_grad():
            for name, param in self.trainer.peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 1e-3)
        self.trainer.maintenance.merge_all()  # serving runs with these weights too, as after a step
        self.method = self.trainer.method
        self.given_responses = False
        self.context = self.trainer.context

    def serve(self, prompt: list[int], record: bool, request_id: str, tracker: SavedTensorTracker | None = None,
              max_tokens: int = 1, engine: LLMEngine | None = None) -> float:
        """Serves `prompt` (greedy, exactly `max_tokens` tokens) on `engine` (the bench's
        by default); returns the prefill step's seconds."""
        engine = engine or self.engine
        engine.runner.record_tracker = tracker
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
        engine.add_request(request_id, prompt, params, train=record)
        seconds = None
        while engine.has_unfinished():
            started = synchronized_clock()
            engine.step()
            seconds = seconds if seconds is not None else synchronized_clock() - started
        engine.runner.record_tracker = None
        return seconds

    def make_stale(self):
        """One adapter version passes after a recording (its weights stashed, the live ones
        moved as a step would move them); -> (context that runs with the recording's
        version's weights, a function that puts the live weights back)."""
        trainer, version = self.trainer, self.trainer.optimizer.version
        trainer.stash.keep(version)
        params = lora_parameters(trainer.peft_model)
        served = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn_like(p) * 1e-3)

        def restore():
            with torch.no_grad():
                for p, value in zip(params, served):
                    p.copy_(value)
            trainer.stash.release_except(set())

        return (lambda: trainer.stash.weights_of(version)), restore

    def entry(self, prompt: list[int], round_index: int, chosen: list[int] | None, response_len: int,
              tracker: SavedTensorTracker):
        """A recorded entry; for DPO, as in the paper's evaluation, the served response
        (response_len tokens) is the rejected one and `chosen` a given text — or, with
        `given_responses`, both given (nothing decoded: long sweeps on a slow decoder)."""
        request_id = f"bench-{round_index}-{time.monotonic_ns()}"
        decoded = 1 if self.given_responses else max(response_len, 1)
        seconds = self.serve(prompt, True, request_id, tracker, max_tokens=decoded)
        entry = self.trainer.cache.get(request_id)
        if chosen is not None and self.given_responses:
            rejected = synthetic_tokens(self.tokenizer, response_len - 1, round_index + 80)
            entry.label = PreferenceLabel(chosen, rejected + [self.tokenizer.eos_token_id])
        elif chosen is not None:
            entry.label = PreferenceLabel(chosen, list(entry.responses[0]),
                                          served_logps={"rejected": entry.served_logps[0]})
        return entry, seconds

    def tokens_only(self, entry):
        """The recompute path's copy of `entry`: same tokens and label, nothing recorded
        (each path's job computes the DPO reference itself, as the trainer's jobs do)."""
        copy = self.method.make_label_entry(entry.completion_id + "-tokens", entry.prompt_token_ids,
                                            entry.adapter_version)
        copy.responses, copy.served_logps = dict(entry.responses), dict(entry.served_logps)
        if hasattr(entry, "label"):
            copy.label = entry.label
        return copy

    def run_job(self, job, tracker: SavedTensorTracker | None, weights=contextlib.nullcontext,
                slices: list | None = None) -> tuple[float, dict, float]:
        """(seconds, LoRA gradients, longest slice's seconds) of a job run to its end, slice
        by slice as the trainer runs it, with `weights()` entered and `tracker` counting
        what it saves (None: nothing counted, as the server runs it). `slices`, when
        given, gets each slice's (seconds, saved bytes live when it began, when it ended)."""
        self.trainer.optimizer.zero_grad()
        longest = 0.0
        with tracker.hooks() if tracker is not None else contextlib.nullcontext(), weights():
            started = last = synchronized_clock()
            while True:
                live = tracker.live_bytes if tracker is not None else 0
                try:
                    next(job)
                except StopIteration:
                    break
                finally:
                    now = synchronized_clock()
                    if slices is not None:
                        slices.append((now - last, live, tracker.live_bytes if tracker is not None else 0))
                    longest, last = max(longest, now - last), now
            seconds = last - started
        grads = lora_gradients(self.trainer.peft_model)
        self.trainer.optimizer.zero_grad()
        return seconds, grads, longest


def _paths(bench: Bench, prompt: list[int], r: int, chosen: list[int] | None, response_len: int, stale: bool,
           trackers: dict[str, SavedTensorTracker] | None) -> tuple[dict, float]:
    """Records `prompt` and trains on the entry both ways, in alternating order; with
    `trackers` ({"reuse", "recompute"}), each path's saved bytes counted by its tracker,
    the recording's by the reuse path's. -> ({path: run_job's result}, recorded prefill's seconds)."""
    reuse_tracker = trackers["reuse"] if trackers else None
    entry, recorded_s = bench.entry(prompt, r, chosen, response_len, reuse_tracker)
    weights, restore = bench.make_stale() if stale else (contextlib.nullcontext, lambda: None)
    tokens_only = bench.tokens_only(entry)
    # alternating order on the CPU; on a GPU reuse first, so that the recording is gone
    # before the recompute path runs (both at once would not fit at the longer lengths)
    reuse_first = r % 2 == 0 or bench.engine.runner.device.type == "cuda"
    results = {}
    for path in (("reuse", "recompute") if reuse_first else ("recompute", "reuse")):
        tracker = trackers[path] if trackers else None
        if path == "reuse":
            results[path] = bench.run_job(bench.method.reuse_job(entry, bench.context), tracker, weights)
            bench.trainer.cache.end(entry, EntryState.TRAINED)
        else:
            results[path] = bench.run_job(bench.method.baseline_job(tokens_only, bench.context), tracker, weights)
    restore()
    return results, recorded_s


def measure(bench: Bench, mode: str, tokens: int, repeats: int, stale: bool = False) -> dict:
    """Reuse against recompute on fresh entries; with `stale`, on entries one adapter
    version old: reuse with that version's weights stashed, recompute with them loaded.
    Each round trains twice: timed as the server runs (no tracker: a shape recorded
    before is recorded without saved-tensor hooks where the server does so,
    engine/saved_bytes_memo.py), then with the trackers' hooks, for the saved bytes and
    the gradients."""
    if mode == "cpt":
        prompt_len, response_len = tokens, 0
    else:
        prompt_len, response_len = tokens // 2, tokens // 4
    rows = []
    for r in range(repeats + 1):  # round 0 warms up and is not reported
        prompt = synthetic_tokens(bench.tokenizer, prompt_len, r)
        chosen = None
        if mode == "dpo":
            chosen = synthetic_tokens(bench.tokenizer, response_len - 1, r + 50) + [bench.tokenizer.eos_token_id]
        plain_s = bench.serve(prompt, False, f"plain-{r}-{time.monotonic_ns()}")
        timed, recorded_s = _paths(bench, prompt, r, chosen, response_len, stale, None)
        trackers = {"reuse": SavedTensorTracker(), "recompute": SavedTensorTracker()}
        tracked, _ = _paths(bench, prompt, r, chosen, response_len, stale, trackers)
        if r == 0:
            continue
        rows.append({
            "reuse_s": timed["reuse"][0], "recompute_s": timed["recompute"][0],
            "reuse_peak_bytes": trackers["reuse"].peak_bytes, "recompute_peak_bytes": trackers["recompute"].peak_bytes,
            # both passes: with the hooks and without (the recording, on the GPU's path)
            "grad_rel_diff": max(rel_diff(tracked["reuse"][1], tracked["recompute"][1]),
                                 rel_diff(timed["reuse"][1], timed["recompute"][1])),
            "reuse_max_slice_s": timed["reuse"][2], "recompute_max_slice_s": timed["recompute"][2],
            "recording_overhead": recorded_s / plain_s,
        })
        print(f"  {mode} {tokens:5d} tokens  round {r}/{repeats}: {'stashed ' if stale else ''}reuse {rows[-1]['reuse_s']:.3f}s  "
              f"recompute {rows[-1]['recompute_s']:.3f}s  memory {rows[-1]['reuse_peak_bytes'] / 2**20:.0f} / "
              f"{rows[-1]['recompute_peak_bytes'] / 2**20:.0f} MiB  recording x{rows[-1]['recording_overhead']:.2f}",
              flush=True)
    reuse_s = statistics.median(row["reuse_s"] for row in rows)
    recompute_s = statistics.median(row["recompute_s"] for row in rows)
    reuse_peak = statistics.median(row["reuse_peak_bytes"] for row in rows)
    recompute_peak = statistics.median(row["recompute_peak_bytes"] for row in rows)
    return {
        "mode": mode, "tokens": tokens, "prompt_tokens": prompt_len, "response_tokens": response_len,
        "repeats": repeats, "stale": stale,
        **({"dpo_reference": bench.trainer.config.dpo_reference} if mode == "dpo" else {}),
        "reuse_tokens_per_s": round(tokens / reuse_s, 2),
        "baseline_tokens_per_s": round(tokens / recompute_s, 2),
        "speedup": round(recompute_s / reuse_s, 3),
        "reuse_peak_activation_bytes": int(reuse_peak),
        "baseline_peak_activation_bytes": int(recompute_peak),
        "memory_ratio": round(reuse_peak / recompute_peak, 3),
        "max_grad_rel_diff": max(row["grad_rel_diff"] for row in rows),
        "recording_overhead": round(statistics.median(row["recording_overhead"] for row in rows), 3),
        # the longest training slice (what a request arriving mid-job waits for, at most)
        "reuse_max_slice_s": round(max(row["reuse_max_slice_s"] for row in rows), 4),
        "recompute_max_slice_s": round(max(row["recompute_max_slice_s"] for row in rows), 4),
        "rounds": rows,
    }


def _measure_or_note_oom(bench: Bench, mode: str, tokens: int, repeats: int, stale: bool) -> dict:
    """`measure`, or a row saying the length does not fit on the device (the separate
    trainer runs out first: that is a result, not a crash)."""
    try:
        return measure(bench, mode, tokens, repeats, stale)
    except torch.OutOfMemoryError:
        bench.trainer.optimizer.zero_grad()
        for entry in bench.trainer.cache.entries():
            bench.trainer.cache.end(entry, EntryState.DROPPED)
        for unfinished in bench.engine.request_ids():  # a prefill that ran out of memory: not the next length's
            bench.engine.abort_request(unfinished)
        torch.cuda.empty_cache()
        print(f"  {mode} {tokens:5d} tokens: out of device memory", flush=True)
        return {"mode": mode, "tokens": tokens, "out_of_memory": True}


def profile_jobs(bench: Bench, mode: str, tokens: int, path: str) -> None:
    """One entry of `tokens` trained tokens, each path's job run once under the profiler."""
    prompt_len, response_len = (tokens, 0) if mode == "cpt" else (tokens // 2, tokens // 4)
    chosen = None
    if mode == "dpo":
        chosen = synthetic_tokens(bench.tokenizer, response_len - 1, 99) + [bench.tokenizer.eos_token_id]
    entry, _ = bench.entry(synthetic_tokens(bench.tokenizer, prompt_len, 99), 99, chosen, response_len,
                           SavedTensorTracker())
    tokens_only = bench.tokens_only(entry)
    write_profile(path, {"reuse": lambda: run_to_end(bench.method.reuse_job(entry, bench.context)),
                         "recompute": lambda: run_to_end(bench.method.baseline_job(tokens_only, bench.context))})
    bench.trainer.optimizer.zero_grad()
    bench.trainer.cache.end(entry, EntryState.TRAINED)


def plot_sweep(results: list[dict], mode: str, prefix: str) -> list[str]:
    plt = pyplot()

    lengths = [r["tokens"] for r in results]
    x = range(len(lengths))
    width = 0.38
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - width / 2 for i in x], [r["reuse_tokens_per_s"] for r in results], width, label="alchemist (reuse)",
           color="tab:blue")
    ax.bar([i + width / 2 for i in x], [r["baseline_tokens_per_s"] for r in results], width,
           label="baseline (recompute)", color="tab:red")
    for i, r in enumerate(results):
        ax.annotate(f"{r['speedup']:.2f}x", (i - width / 2, r["reuse_tokens_per_s"]), ha="center", va="bottom",
                    fontsize=9)
    ax.set_xticks(list(x), [str(n) for n in lengths])
    paths.append(save_figure(fig, ax, "trained tokens", "training tokens / s",
                             f"Training throughput, {mode.upper()} (cf. paper Fig. 8)", f"{prefix}-throughput.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(lengths, [r["reuse_peak_activation_bytes"] / 2**20 for r in results], "o-", label="alchemist (reuse)",
            color="tab:blue")
    ax.plot(lengths, [r["baseline_peak_activation_bytes"] / 2**20 for r in results], "s-",
            label="baseline (recompute)", color="tab:red")
    for r in results:
        ax.annotate(f"{r['memory_ratio']:.2f}", (r["tokens"], r["reuse_peak_activation_bytes"] / 2**20),
                    textcoords="offset points", xytext=(0, -14), ha="center", fontsize=9)
    paths.append(save_figure(fig, ax, "trained tokens", "peak activation memory (MiB, measured)",
                             f"Peak activation memory, {mode.upper()} (cf. paper's memory-saving figure)",
                             f"{prefix}-memory.png"))
    return paths


def run_training_bench(config: AlchemistConfig, mode: str, tokens: int, repeats: int = 3,
                       json_path: str | None = None, sweep: list[int] | None = None,
                       plot_prefix: str | None = None, stale: bool = False, max_fit: list[int] | None = None,
                       given_responses: bool = False, profile_path: str | None = None) -> dict:
    lengths = sweep or [tokens]
    bench = Bench(config, mode, max(lengths + (max_fit or [])))
    bench.given_responses = given_responses
    results = [_measure_or_note_oom(bench, mode, n, repeats, stale) for n in lengths]
    device = next(bench.engine.model.parameters()).device
    summary = {"model": bench.name, "dtype": str(next(bench.engine.model.parameters()).dtype),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch_threads": torch.get_num_threads(), "lora_rank": bench.trainer.config.lora_rank,
               "given_responses": given_responses,
               "results": results}
    if profile_path:
        profile_jobs(bench, mode, lengths[-1], profile_path)
    if max_fit:
        from bench.fit import longest_fit
        summary["max_fit"] = longest_fit(bench, mode, max_fit)
        print(json.dumps({"max_fit": summary["max_fit"]}))
    if sweep:
        fitted = [r for r in results if not r.get("out_of_memory")]
        summary["plots"] = plot_sweep(fitted, mode, plot_prefix or f"bench-training-{mode}")
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "rounds"}))
    write_json(summary if sweep else {**summary, **{k: v for k, v in results[0].items()}}, json_path)
    return summary
