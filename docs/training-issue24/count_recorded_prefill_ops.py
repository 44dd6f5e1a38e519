"""Aten ops (and views) of one prefill step on a tiny Llama, recorded for training against
plain, with the adapter's merged serving weights current (as a server serves between
optimizer steps). Each op is a kernel launch on a GPU. Run from the repository root:

    .venv/bin/python docs/training-issue24/count_recorded_prefill_ops.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.step_counts import AtenOps  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import encode, engine_of, make_training  # noqa: E402
from trainer.adapter import merge_all  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    trainer = make_training(TrainConfig(mode="dpo", lora_rank=4), init_lora_weights=False)
    engine = engine_of(trainer)
    merge_all(trainer.peft_model)
    prompt = encode("The quick brown fox jumps over the lazy dog. " * 3)
    counts = {}
    for repeat in range(2):  # the second of each is counted
        for recorded in (False, True):
            engine.add_request(f"{recorded}-{repeat}", prompt, SamplingParams(temperature=0.0, max_tokens=1),
                               train=recorded)
            counter = AtenOps()
            with counter.counting():
                engine.step()  # the prefill
            while engine.has_unfinished():
                engine.step()
            counts[recorded] = counter
    plain, recorded = counts[False], counts[True]
    print(f"prefill step, {len(prompt)} tokens: plain {plain.total} ops ({plain.views} views), "
          f"recorded {recorded.total} ops ({recorded.views} views)")
    for name in sorted(set(plain.ops) | set(recorded.ops), key=lambda k: plain.ops[k] - recorded.ops[k]):
        if plain.ops[name] != recorded.ops[name]:
            print(f"  {name:45s} {plain.ops[name]:4d} {recorded.ops[name]:4d}")


if __name__ == "__main__":
    main()
