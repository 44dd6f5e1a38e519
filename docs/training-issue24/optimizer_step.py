"""The optimizer step that ends a training job, with AdamW's fused kernel against torch's
plain implementation, side by side in one process on the embedded model (LoRA on every
linear, the server's defaults), alternating round by round:

- AdamW's step alone over the adapter's tensors: median time, and the aten ops it
  dispatches (each a kernel launch on a GPU);
- the serving copies refreshed from the masters, each group alone (`group.refresh()`) and
  all at once (`refresh_serving_copies`, what a step does): median time and aten ops;
- the trainer's whole "optimizer step" slice (`Trainer._finish_job`: clipping, AdamW,
  the serving copies refreshed, the entries ended) after a DPO job of four labelled
  100-token requests: the longest slice a request arriving meanwhile can wait behind.

Run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/training-issue24/optimizer_step.py --rounds 8
"""

import argparse
import json
import statistics
import time

import torch

from bench.step_counts import AtenOps
from bench.training import Bench
from bench.traces import synthetic_tokens
from server.config import AlchemistConfig
from trainer.adapter import lora_parameters
from trainer.feedback import FeedbackLabel
from trainer.optimizer import adamw
from trainer.serving_copy import refresh_serving_copies

IMPLEMENTATIONS = ("plain", "fused")


def adamw_alone(params, rounds: int) -> dict:
    """AdamW's step over `params` (copies), each implementation in turn, 5 steps a round."""
    copies = {name: [torch.nn.Parameter(p.detach().clone()) for p in params] for name in IMPLEMENTATIONS}
    optimizers = {name: adamw(copies[name], 1e-4, fused=name == "fused") for name in IMPLEMENTATIONS}
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    seconds = {name: [] for name in IMPLEMENTATIONS}
    ops = {}
    for round_index in range(rounds + 1):  # the first round builds AdamW's state: not timed
        for name in IMPLEMENTATIONS if round_index % 2 else reversed(IMPLEMENTATIONS):
            for param, grad in zip(copies[name], grads):
                param.grad = grad
            if round_index == 1:
                counter = AtenOps()
                with counter.counting():
                    optimizers[name].step()
                ops[name] = counter.total
            for _ in range(5):
                started = time.perf_counter()
                optimizers[name].step()
                if round_index:
                    seconds[name].append(time.perf_counter() - started)
    return {"tensors": len(params), "parameters": sum(p.numel() for p in params), "aten_ops": ops,
            **{f"{name}_ms": 1000 * statistics.median(seconds[name]) for name in IMPLEMENTATIONS}}


def refresh_alone(groups, rounds: int) -> dict:
    """The serving copies refreshed group by group against all at once, in turn."""
    ways = {"by_group": lambda: [group.refresh() for group in groups], "at_once": lambda: refresh_serving_copies(groups)}
    seconds, ops = {name: [] for name in ways}, {}
    for round_index in range(rounds + 1):
        for name, refresh in ways.items() if round_index % 2 else reversed(ways.items()):
            if round_index == 1:
                counter = AtenOps()
                with counter.counting():
                    refresh()
                ops[name] = counter.total
            for _ in range(5):
                started = time.perf_counter()
                refresh()
                if round_index:
                    seconds[name].append(time.perf_counter() - started)
    return {"groups": len(groups), "aten_ops": ops, **{f"{name}_ms": 1000 * statistics.median(seconds[name])
                                                       for name in ways}}


def finish_job_slices(bench: Bench, rounds: int, entries: int = 4) -> dict:
    """The trainer's optimizer-step slice after each job, its AdamW swapped round by round."""
    online, trainer = bench.trainer, bench.trainer.trainer
    params = lora_parameters(online.peft_model)
    optimizers = {name: adamw(params, trainer.optimizer.optimizer.defaults["lr"], fused=name == "fused")
                  for name in IMPLEMENTATIONS}
    finish_job, current, seconds = trainer._finish_job, [None], {name: [] for name in IMPLEMENTATIONS}

    def timed(job):
        started = time.perf_counter()
        finish_job(job)
        seconds[current[0]].append(time.perf_counter() - started)

    trainer._finish_job = timed
    for round_index in range(2 * rounds + 2):  # the first two rounds warm both up: not kept
        name = IMPLEMENTATIONS[round_index % 2]
        for i in range(entries):
            request_id = f"round{round_index}-{i}"
            bench.serve(synthetic_tokens(bench.tokenizer, 100, 10 * round_index + i), True, request_id, max_tokens=8)
            assert online.feedback.submit(FeedbackLabel(request_id, "Paris is the capital of France.")).accepted
        trainer.optimizer.optimizer, current[0] = optimizers[name], name
        online.train_until_idle()
        if round_index < 2:
            seconds[name].clear()
    trainer._finish_job = finish_job
    return {"entries_per_job": entries, "rounds": rounds,
            **{f"{name}_ms": [round(1000 * s, 1) for s in seconds[name]] for name in IMPLEMENTATIONS},
            **{f"{name}_median_ms": 1000 * statistics.median(seconds[name]) for name in IMPLEMENTATIONS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    bench = Bench(AlchemistConfig(), "dpo", 200)
    alone = adamw_alone(lora_parameters(bench.trainer.peft_model), args.rounds)
    refresh = refresh_alone(bench.trainer.maintenance.serving_copies, args.rounds)
    slices = finish_job_slices(bench, args.rounds)
    result = {"adamw_alone": alone, "serving_copies_refresh": refresh, "optimizer_step_slice": slices,
              "adamw_plain_over_fused": alone["plain_ms"] / alone["fused_ms"],
              "refresh_by_group_over_at_once": refresh["by_group_ms"] / refresh["at_once_ms"],
              "slice_plain_over_fused": slices["plain_median_ms"] / slices["fused_median_ms"]}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
