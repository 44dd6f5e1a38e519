"""A cached beginning's training with fewer of its layers' graphs kept, side by side.

A recording that read a prompt's beginning from the prefix cache leaves its job to
recompute that beginning (trainer.methods.cached_prefix_backward): with every layer's
graph kept through its forward (no device budget, or room in it), or — as much as the
budget has room for — only the top layers', each layer below keeping its input and run
again in the backward (`cached_prefix_backward`'s `graph_layers`). Three ways here: every
layer's graph kept, the top half's, none. All take the same gK/gV.

Each round, on the embedded model (`alchemist bench training`'s `Bench`, DPO, prefix cache
on): a fresh beginning of `--cached` tokens served untrained (cached), then a recorded turn
of `--new` tokens after it and a given chosen response; the label's reuse job runs to its
end (timed: the whole job, its beginning kept whole), which leaves the beginning's real
gK/gV on the recording's leaves. Then the beginning's backward alone, each way, in an
order reversed every round: timed without a tracker, then again counting what autograd
saves (peak), with the inputs kept for the layers run again beside it; the LoRA
gradients of each way compared with every layer's graph kept. Medians over the rounds after a warm-up round. From the root:

    PYTHONPATH=. .venv/bin/python docs/beginning-layer-by-layer-2026-12-02/beginning_costs.py --rounds 5 \\
        --json docs/beginning-layer-by-layer-2026-12-02/beginning_costs.json \\
        --plot docs/bench-beginning-layer-by-layer.png
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch

from bench.report import pyplot, rel_diff, rounds_after_warm_up, save_figure, write_json
from bench.traces import synthetic_tokens
from bench.training import Bench
from engine.recording import SavedTensorTracker
from server.config import AlchemistConfig
from trainer.entries import EntryState
from trainer.methods import cached_prefix_backward

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recorded-prefix-2026-12-01"))
from job_costs import turn_arguments  # noqa: E402  (the same turn's shape as the job costs' there)

WAYS = {"all": 1.0, "half": 0.5, "none": 0.0}  # the share of the layers whose graphs are kept


def make_bench(max_tokens: int) -> Bench:
    config = AlchemistConfig()
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_prefix_caching=True))
    torch.manual_seed(0)
    return Bench(config, "dpo", max_tokens)


def one_round(bench: Bench, r: int, args) -> dict:
    tokenizer = bench.tokenizer
    beginning = synthetic_tokens(tokenizer, args.cached, r)
    turn = synthetic_tokens(tokenizer, args.new, r + 300)
    chosen = synthetic_tokens(tokenizer, args.response - 1, r + 50) + [tokenizer.eos_token_id]
    bench.serve(beginning, False, f"beginning-{r}-{time.monotonic_ns()}")
    entry, _ = bench.entry(beginning + turn, r, chosen, args.response, None)
    recording = entry.recording
    assert recording.prefix_len > 0
    row = {"cached_tokens": recording.prefix_len}
    row["job_s"], _, _ = bench.run_job(bench.method.reuse_job(entry, bench.context), None)
    assert all(g.key is not None for g in recording.prefix_grads)  # the beginning's gK/gV, left by the job
    layers = len(bench.engine.runner.layers)
    kept = {way: round(share * layers) for way, share in WAYS.items()}
    grads = {}
    for way in (list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]):
        row[f"{way}_s"], grads[way], row[f"{way}_longest_slice_s"] = bench.run_job(
            cached_prefix_backward(recording, bench.context, graph_layers=kept[way]), None)
    hidden_row = bench.trainer.peft_model.config.hidden_size * recording.prefix_grads[0].key.element_size()
    for way in WAYS:
        tracker = SavedTensorTracker()
        bench.run_job(cached_prefix_backward(recording, bench.context, graph_layers=kept[way]), tracker)
        inputs = (layers - kept[way]) * recording.prefix_len * hidden_row
        row[f"{way}_held_mib"] = (tracker.peak_bytes + inputs) / 2 ** 20
        if way != "all":
            row[f"{way}_grad_rel_diff"] = rel_diff(grads[way], grads["all"])
    bench.trainer.cache.end(entry, EntryState.TRAINED)
    return row


def plot(summary: dict, path: str) -> None:
    """Each way's median seconds against what it held, one point per way."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    median = summary["medians"]
    for way, label in (("all", "every layer's graph kept"), ("half", "the top half's kept"),
                       ("none", "none kept: each layer run again")):
        ax.scatter([median[f"{way}_held_mib"]], [median[f"{way}_s"]], s=60, label=label)
    ax.set_xlim(left=0)
    ax.set_ylim(0, 1.5 * max(median[f"{way}_s"] for way in WAYS))  # (room above the points for the legend)
    shape = summary["shape"]
    save_figure(fig, ax, "held at the peak, MiB (saved by autograd + inputs kept)", "seconds (median)",
                f"Training a {shape['cached']}-token cached beginning, embedded model, CPU", path)


def main() -> None:
    parser = turn_arguments()
    parser.add_argument("--plot")
    args = parser.parse_args()
    bench = make_bench(args.cached + args.new + args.response + 64)
    rows, median = rounds_after_warm_up(lambda r: one_round(bench, r, args), args.rounds)
    summary = {
        "shape": {"cached": args.cached, "new": args.new, "response": args.response}, "rounds": args.rounds,
        "medians": median,
        "beginning_share_of_job": round(median["all_s"] / median["job_s"], 3),
        "time_over_all": {way: round(median[f"{way}_s"] / median["all_s"], 3) for way in WAYS},
        "held_over_all": {way: round(median[f"{way}_held_mib"] / median["all_held_mib"], 3) for way in WAYS},
        "max_grad_rel_diff": {way: max(row[f"{way}_grad_rel_diff"] for row in rows) for way in WAYS if way != "all"},
    }
    print(json.dumps(summary, indent=2))
    write_json({"summary": summary, "rounds": rows}, args.json)
    if args.plot:
        plot(summary, args.plot)


if __name__ == "__main__":
    main()
