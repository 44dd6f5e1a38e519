"""Aten ops per training job on a tiny Llama (hidden 64), reuse against recompute — CPT,
DPO (the `base` reference) and GRPO with the KL term to the base model (a group of 4) — for a
float32 model and a bfloat16 one with the LoRA math in the model's dtype (the training
copies, `train.lora_compute_dtype = "model"`) or in PEFT's float32: the whole job on 2
layers, and per decoder layer (the issue's unit: the job on 4 layers less the job on 2,
halved — what the head, the loss and the embedding cost drops out). Each op is a kernel
launch on a GPU. Run from the repository root:

    .venv/bin/python docs/training-issue24/count_job_ops.py
"""

import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.step_counts import AtenOps  # noqa: E402
from engine.model_runner import run_to_end  # noqa: E402
from tests.conftest import make_training  # noqa: E402
from tests.test_grpo import reward, serve_group  # noqa: E402
from tests.test_training import label, serve  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402


def counted_jobs(mode: str, dtype: torch.dtype, compute: str, num_layers: int, paths: dict[str, str],
                 make_counter: Callable) -> dict:
    """Per path (its name -> the method's job attribute), what `make_counter()` (an object
    with a `counting()` context) counted while that job ran on one entry, after a first
    job on another (the copies are built once per version, not per job)."""
    torch.manual_seed(0)
    beta = {"grpo_beta": 0.04} if mode == "grpo" else {}
    trainer = make_training(TrainConfig(mode=mode, lora_rank=4, lora_compute_dtype=compute, **beta), dtype=dtype,
                            num_layers=num_layers, init_lora_weights=False)
    counts = {}
    for path, attribute in paths.items():
        job = getattr(trainer.method, attribute)
        for request_id in ("warm-up", "counted"):  # each job computes its entry's reference itself
            if mode == "grpo":
                serve_group(trainer, f"{path}-{request_id}")
                assert reward(trainer, f"{path}-{request_id}").accepted
                continue
            serve(trainer, f"{path}-{request_id}", max_tokens=8)
            if mode == "dpo":
                label(trainer, f"{path}-{request_id}", chosen="Paris, of course. It is a lovely city.")
        entries = [trainer.cache.get(f"{path}-{request_id}") for request_id in ("warm-up", "counted")]
        run_to_end(job(entries[0], trainer.context))
        trainer.optimizer.zero_grad()
        counter = make_counter()
        with counter.counting():
            run_to_end(job(entries[1], trainer.context))
        trainer.optimizer.zero_grad()
        counts[path] = counter
    return counts


def job_ops(mode: str, dtype: torch.dtype, compute: str, num_layers: int = 2) -> dict[str, AtenOps]:
    return counted_jobs(mode, dtype, compute, num_layers, {"reuse": "reuse_job", "recompute": "baseline_job"},
                        AtenOps)


def main() -> None:
    print("| job | model, LoRA math | reuse ops (casts) | recompute ops (casts) | reuse / recompute "
          "| per layer: reuse / recompute |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for mode in ("cpt", "dpo", "grpo"):
        for dtype, compute in ((torch.float32, "model"), (torch.bfloat16, "float32"), (torch.bfloat16, "model")):
            counts = job_ops(mode, dtype, compute)
            deeper = job_ops(mode, dtype, compute, num_layers=4)
            reuse, recompute = counts["reuse"], counts["recompute"]
            per_layer = {path: (deeper[path].total - counts[path].total) / 2 for path in counts}
            math = "PEFT float32" if compute == "float32" else "bfloat16 copies"
            name = "float32" if dtype == torch.float32 else f"bfloat16, {math}"
            print(f"| {mode} | {name} | {reuse.total:,} ({reuse.ops['_to_copy']}) | "
                  f"{recompute.total:,} ({recompute.ops['_to_copy']}) | {reuse.total / recompute.total:.2f}x | "
                  f"{per_layer['reuse']:.0f} / {per_layer['recompute']:.0f} = "
                  f"{per_layer['reuse'] / per_layer['recompute']:.2f}x |")


if __name__ == "__main__":
    main()
