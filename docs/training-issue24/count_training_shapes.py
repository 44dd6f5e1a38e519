"""Distinct attention shapes of recorded prefills and DPO jobs over prompts of many
lengths, exact (the CPU's) against bucketed (a GPU's, where each new shape builds a fused
kernel's graph), on a tiny Llama. Each prompt is served, labelled and trained, half on
the recording (reuse), half by recomputation. Run from the repository root:

    .venv/bin/python docs/training-issue24/count_training_shapes.py
"""

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.step_counts import AttentionShapes  # noqa: E402
from engine.model_runner import run_to_end  # noqa: E402
from engine.step_inputs import training_buckets  # noqa: E402
from tests.test_training import label, make_trainer, serve  # noqa: E402

PROMPTS = 24


def shapes(bucketed: bool) -> dict[str, int]:
    torch.manual_seed(0)
    trainer = make_trainer(mode="dpo")
    runner = trainer.context.runner
    runner.training_buckets = training_buckets(torch.device("cuda"), runner.block_size, runner.decode_keys[-1]) \
        if bucketed else None
    rng = random.Random(0)
    recorded, jobs = AttentionShapes(), AttentionShapes()
    for i in range(PROMPTS):
        prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(2, 36)))
        with recorded.recording():
            serve(trainer, f"r{i}", prompt=prompt + " What is the capital of France?", max_tokens=4)
        label(trainer, f"r{i}", chosen="Paris" + "!" * rng.randint(1, 40), rejected="Rome" + "." * rng.randint(1, 40))
        entry = trainer.cache.get(f"r{i}")
        job = trainer.method.reuse_job if i % 2 == 0 else trainer.method.baseline_job
        with jobs.recording():
            run_to_end(job(entry, trainer.context))
        trainer.optimizer.zero_grad()
    prefill = sum(1 for (query, *_rest) in recorded.shapes if query[2] > 1)
    return {"recorded prefills": prefill, "DPO jobs": jobs.distinct}


def main() -> None:
    exact, bucketed = shapes(False), shapes(True)
    print(f"{PROMPTS} prompts of 2-36 words, chosen and rejected of 1-40 extra characters")
    print("| attention calls | exact shapes | bucketed |")
    print("| --- | ---: | ---: |")
    for name in exact:
        print(f"| {name} | {exact[name]} | {bucketed[name]} |")


if __name__ == "__main__":
    main()
