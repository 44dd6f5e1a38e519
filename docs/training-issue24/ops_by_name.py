"""Aten ops per decoder layer of the CPT and DPO jobs, by op name, reuse and recompute:
the tiny bfloat16 Llama with the training copies (the GPU's path), per layer as
count_job_ops.py takes it (the job on 4 layers less the job on 2, halved). CPT's reuse job
is the prompt's backward alone, so its count is what DPO's reuse job adds to a packed
forward and backward of the responses. Run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/training-issue24/ops_by_name.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from count_job_ops import job_ops  # noqa: E402


def main() -> None:
    for mode in ("cpt", "dpo"):
        shallow = job_ops(mode, torch.bfloat16, "model", 2)
        deep = job_ops(mode, torch.bfloat16, "model", 4)
        for path in ("reuse", "recompute"):
            names = set(shallow[path].ops) | set(deep[path].ops)
            per_layer = {n: (deep[path].ops[n] - shallow[path].ops[n]) / 2 for n in names}
            per_layer = {n: v for n, v in sorted(per_layer.items(), key=lambda kv: -kv[1]) if v}
            listed = ", ".join(f"{n} {v:g}" for n, v in per_layer.items())
            print(f"{mode} {path}: {sum(per_layer.values()):g} per layer — {listed}")


if __name__ == "__main__":
    main()
