"""What recording after a cached beginning costs and saves, in one process, side by side.

A conversation's next turn on a DPO training server: a beginning of `--cached` tokens the
prefix cache holds (served once untrained, as the turns before left it), then `--new`
tokens of the new turn, then a `--response`-token answer and a given chosen response.
Two engines on the embedded model (`alchemist bench training`'s `Bench`, prefix cache on):
one recording after the cached beginning (the default now), one recording the whole prompt
(`train.record_after_cached_prefix = false`, the tree before). Each round, a fresh
beginning on both, in alternating order:
  - the recorded prefill step (the turn's time to first token) on each, and a plain
    prefill of the same shape after the cached beginning (training off's);
  - the label's training job on each: the reuse job on each engine's recording, and the
    recompute job (the server's, for an entry without a recording) on the first.
Medians over the rounds after a warm-up round, with the ratios, and the gradients of the
two reuse jobs against the recompute job's and each other's. Run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/recorded-prefix-2026-12-01/job_costs.py --rounds 5 \
        --json docs/recorded-prefix-2026-12-01/job_costs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from bench.report import rel_diff, rounds_after_warm_up, write_json
from bench.traces import synthetic_tokens
from bench.training import Bench
from server.config import AlchemistConfig
from trainer.entries import EntryState


def make_bench(reads_cache: bool, max_tokens: int) -> Bench:
    config = AlchemistConfig()
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_prefix_caching=True),
                                 train=dataclasses.replace(config.train, record_after_cached_prefix=reads_cache))
    torch.manual_seed(0)  # the same LoRA weights on both
    return Bench(config, "dpo", max_tokens)


def one_round(benches: dict[str, Bench], r: int, args) -> dict:
    tokenizer = benches["reads_cache"].tokenizer
    beginning = synthetic_tokens(tokenizer, args.cached, r)
    turn = synthetic_tokens(tokenizer, args.new, r + 300)
    chosen = synthetic_tokens(tokenizer, args.response - 1, r + 50) + [tokenizer.eos_token_id]
    row, entries = {}, {}
    order = list(benches) if r % 2 == 0 else list(benches)[::-1]
    for key in order:
        bench = benches[key]
        bench.serve(beginning, False, f"beginning-{r}-{time.monotonic_ns()}")  # cached, as earlier turns leave it
        entries[key], row[f"{key}_recorded_prefill_s"] = bench.entry(beginning + turn, r, chosen, args.response, None)
        assert (entries[key].recording.prefix_len > 0) == (key == "reads_cache")
    other_turn = synthetic_tokens(tokenizer, args.new, r + 600)
    row["plain_prefill_s"] = benches["reads_cache"].serve(beginning + other_turn, False, f"plain-{r}")
    reads = benches["reads_cache"]
    tokens_only = reads.tokens_only(entries["reads_cache"])
    jobs = {"reads_cache": lambda: reads.method.reuse_job(entries["reads_cache"], reads.context),
            "whole_prompt": lambda: benches["whole_prompt"].method.reuse_job(entries["whole_prompt"],
                                                                             benches["whole_prompt"].context),
            "recompute": lambda: reads.method.recompute_job(tokens_only, reads.context)}
    grads = {}
    for key in (["reads_cache", "whole_prompt", "recompute"] if r % 2 == 0 else
                ["recompute", "whole_prompt", "reads_cache"]):
        bench = benches["whole_prompt"] if key == "whole_prompt" else reads
        row[f"{key}_job_s"], grads[key], _ = bench.run_job(jobs[key](), None)
        if key != "recompute":
            bench.trainer.cache.end(entries[key], EntryState.TRAINED)
    row["reads_cache_grad_rel_diff"] = rel_diff(grads["reads_cache"], grads["recompute"])
    row["whole_prompt_grad_rel_diff"] = rel_diff(grads["whole_prompt"], grads["recompute"])
    row["reads_cache_vs_whole_prompt_grad_rel_diff"] = rel_diff(grads["reads_cache"], grads["whole_prompt"])
    return row


def turn_arguments() -> argparse.ArgumentParser:
    """A conversation's next turn: its cached beginning's, new turn's and responses'
    tokens; rounds; where the JSON goes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--cached", type=int, default=1000, help="tokens of the beginning the prefix cache holds")
    parser.add_argument("--new", type=int, default=40, help="tokens of the new turn")
    parser.add_argument("--response", type=int, default=48, help="tokens of each response")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    return parser


def main() -> None:
    args = turn_arguments().parse_args()
    max_tokens = args.cached + args.new + args.response + 64
    benches = {"reads_cache": make_bench(True, max_tokens), "whole_prompt": make_bench(False, max_tokens)}
    rows, median = rounds_after_warm_up(lambda r: one_round(benches, r, args), args.rounds)
    summary = {
        "shape": {"cached": args.cached, "new": args.new, "response": args.response}, "rounds": args.rounds,
        "medians": median,
        "recorded_prefill_whole_over_reads_cache": round(median["whole_prompt_recorded_prefill_s"]
                                                         / median["reads_cache_recorded_prefill_s"], 2),
        "recorded_prefill_reads_cache_over_plain": round(median["reads_cache_recorded_prefill_s"]
                                                         / median["plain_prefill_s"], 3),
        "job_reads_cache_over_whole_prompt": round(median["reads_cache_job_s"] / median["whole_prompt_job_s"], 3),
        "job_reads_cache_over_recompute": round(median["reads_cache_job_s"] / median["recompute_job_s"], 3),
        "job_whole_prompt_over_recompute": round(median["whole_prompt_job_s"] / median["recompute_job_s"], 3),
        "max_grad_rel_diff": {key: max(row[f"{key}_grad_rel_diff"] for row in rows)
                              for key in ("reads_cache", "whole_prompt", "reads_cache_vs_whole_prompt")},
    }
    print(json.dumps(summary, indent=2))
    write_json({"summary": summary, "rounds": rows}, args.json)


if __name__ == "__main__":
    main()
