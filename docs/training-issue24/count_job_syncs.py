"""Host syncs per training job on a tiny Llama, reuse against the server's recompute and the
separate trainer (DPO with the `base` reference; GRPO with the KL term, a group of 4): the
host's reads of tensor data and the tensors it builds from host data (each a wait for the
device on a GPU: bench/step_counts.HostSyncCounter), on 2 decoder layers and on 4. Equal
counts on both depths mean the syncs come per job, not per layer. bfloat16 model, LoRA math
in the model's dtype (the GPU's path). On this CPU the counter also counts a cast with
`copy=True` of a host tensor as a build (trainer/training_copy.py's gradient buffers, per
layer): on a GPU that tensor is on the device, and nothing crosses. Run from the repository
root:

    .venv/bin/python docs/training-issue24/count_job_syncs.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.step_counts import HostSyncCounter  # noqa: E402
from engine.model_runner import run_to_end  # noqa: E402
from tests.conftest import make_training  # noqa: E402
from tests.test_grpo import reward, serve_group  # noqa: E402
from tests.test_training import label, serve  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402


def job_syncs(mode: str, num_layers: int) -> dict[str, HostSyncCounter]:
    torch.manual_seed(0)
    beta = {"grpo_beta": 0.04} if mode == "grpo" else {}
    trainer = make_training(TrainConfig(mode=mode, lora_rank=4, lora_compute_dtype="model", **beta),
                            dtype=torch.bfloat16, num_layers=num_layers, init_lora_weights=False)
    method = trainer.method
    counts = {}
    for path, job in (("reuse", method.reuse_job), ("recompute", method.recompute_job),
                      ("separate trainer", method.baseline_job)):
        for request_id in ("warm-up", "counted"):
            if mode == "grpo":
                serve_group(trainer, f"{path}-{request_id}")
                assert reward(trainer, f"{path}-{request_id}").accepted
                continue
            serve(trainer, f"{path}-{request_id}", max_tokens=8)
            label(trainer, f"{path}-{request_id}", chosen="Paris, of course. It is a lovely city.")
        entries = [trainer.cache.get(f"{path}-{request_id}") for request_id in ("warm-up", "counted")]
        run_to_end(job(entries[0], trainer.context))
        trainer.optimizer.zero_grad()
        counter = HostSyncCounter()
        with counter.counting():
            run_to_end(job(entries[1], trainer.context))
        trainer.optimizer.zero_grad()
        counts[path] = counter
    return counts


def main() -> None:
    print("| job | path | reads, 2 layers / 4 | built from host data, 2 layers / 4 |")
    print("| --- | --- | ---: | ---: |")
    for mode in ("dpo", "grpo"):
        shallow, deep = job_syncs(mode, 2), job_syncs(mode, 4)
        for path in shallow:
            print(f"| {mode} | {path} | {shallow[path].reads} / {deep[path].reads} "
                  f"| {shallow[path].built} / {deep[path].built} |")


if __name__ == "__main__":
    main()
