"""Aten ops of one prefill step on a tiny bfloat16 Llama (the GPU's path: the serving copy,
and the training copies under autograd), plain against recorded — in steady state and
the first after an optimizer step — and of a training job's backward per layer. Each op
is a kernel launch on a GPU (this CPU decomposes RMSNorm under autograd, which a GPU
runs as one kernel each way). Run from the repository root:

    .venv/bin/python docs/training-issue24/count_recorded_prefill_ops_bf16.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.step_counts import AtenOps  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import encode, engine_of, make_training  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402


def prefill_ops(engine, request_id: str, prompt: list[int], recorded: bool) -> AtenOps:
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1), train=recorded)
    counter = AtenOps()
    with counter.counting():
        engine.step()  # the prefill
    while engine.has_unfinished():
        engine.step()
    return counter


def main() -> None:
    torch.manual_seed(0)
    trainer = make_training(TrainConfig(mode="cpt", lora_rank=4, lora_compute_dtype="model", entries_per_step=1),
                            dtype=torch.bfloat16, init_lora_weights=False)
    engine = engine_of(trainer)
    prompt = encode("The quick brown fox jumps over the lazy dog. " * 3)
    counts = {}
    for repeat in range(2):  # the second of each is counted
        counts["plain"] = prefill_ops(engine, f"plain-{repeat}", prompt, False)
        counts["recorded"] = prefill_ops(engine, f"recorded-{repeat}", prompt, True)
    trainer.train_until_idle()  # optimizer steps on the recordings: a new adapter version
    counts["recorded, first after an optimizer step"] = prefill_ops(engine, "after-step", prompt, True)
    print(f"prefill step, {len(prompt)} tokens, bfloat16, training copies:")
    for name, counter in counts.items():
        print(f"  {name:42s} {counter.total:4d} ops ({counter.views} views)")


if __name__ == "__main__":
    main()
