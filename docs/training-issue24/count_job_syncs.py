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
from count_job_ops import counted_jobs  # noqa: E402

PATHS = {"reuse": "reuse_job", "recompute": "recompute_job", "separate trainer": "baseline_job"}


def job_syncs(mode: str, num_layers: int) -> dict[str, HostSyncCounter]:
    return counted_jobs(mode, torch.bfloat16, "model", num_layers, PATHS, HostSyncCounter)


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
