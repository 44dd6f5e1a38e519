"""Held-out learning over HTTP on a bfloat16 server: the LoRA math in bfloat16 (training
copies, the default) against PEFT's float32 math (`train.lora_compute_dtype = "float32"`),
on `alchemist bench backlog`'s scenarios (24 answers labelled back to back: the held-out
preference of examples/learn_a_preference.py; a made-up fact served 12 times: the
held-out fact of examples/learn_a_fact.py). Run from the repository root:

    .venv/bin/python docs/training-issue24/precision_learning.py [dpo,cpt] [--json PATH]
"""

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.backlog import run_condition  # noqa: E402

CONDITIONS = {
    "bfloat16, bfloat16 copies": '[model]\ndtype = "bfloat16"\n',
    "bfloat16, PEFT float32": '[model]\ndtype = "bfloat16"\n[train]\nlora_compute_dtype = "float32"\n',
}


def main() -> None:
    scenarios = sys.argv[1].split(",") if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else ["dpo"]
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in scenarios:
            for name, text in CONDITIONS.items():
                path = Path(tmp, "condition.toml")
                path.write_text(text)
                print(f"{scenario}: {name} ...", flush=True)
                report[f"{scenario}: {name}"] = row = run_condition(scenario, str(path), 1e-4, 1800.0)
                print(f"  {row}", flush=True)
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
