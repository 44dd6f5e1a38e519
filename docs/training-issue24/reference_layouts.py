"""DPO's base reference in the two layouts the jobs use, on the embedded model at 512 trained
tokens (a 256-token prompt, two 128-token responses), alternating in one process: the
server's pack (`reference_logps`: the prompt once, both responses against its keys; the
reuse and recompute jobs) and TRL's batch (`separate_trainer_reference_logps`: both whole
sequences, the prompt twice; the separate trainer's, `baseline_job`). Prints each
round's milliseconds and values, the medians, and each layout's aten ops. Run from the
repository root:

    PYTHONPATH=. .venv/bin/python docs/training-issue24/reference_layouts.py [--rounds 8]
"""

import argparse
import statistics
import time

from bench.step_counts import AtenOps
from bench.traces import synthetic_tokens
from bench.training import Bench
from engine.model_runner import run_to_end
from server.config import AlchemistConfig
from trainer.entries import PreferenceLabel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="the first warms up and is not counted")
    args = parser.parse_args()
    bench = Bench(AlchemistConfig(), "dpo", 600)
    method, ctx, eos = bench.method, bench.context, [bench.tokenizer.eos_token_id]
    layouts = {"pack": method.reference_logps, "trl": method.separate_trainer_reference_logps}
    seconds = {name: [] for name in layouts}
    entry = None
    for r in range(args.rounds):
        entry = method.make_label_entry(f"reference-{r}", synthetic_tokens(bench.tokenizer, 256, r), 0)
        entry.label = PreferenceLabel(synthetic_tokens(bench.tokenizer, 127, r + 10) + eos,
                                      synthetic_tokens(bench.tokenizer, 127, r + 20) + eos)
        for name in (("pack", "trl") if r % 2 else ("trl", "pack")):
            started = time.perf_counter()
            values = run_to_end(layouts[name](entry, ctx))
            elapsed = time.perf_counter() - started
            seconds[name] += [elapsed] if r else []
            print(f"round {r} {name}: {elapsed * 1000:.0f} ms, (chosen, rejected) = {values}")
    pack, trl = (statistics.median(seconds[name]) for name in ("pack", "trl"))
    print(f"median: pack {pack * 1000:.0f} ms, trl {trl * 1000:.0f} ms, trl / pack {trl / pack:.2f}x")
    for name, layout in layouts.items():
        counter = AtenOps()
        with counter.counting():
            run_to_end(layout(entry, ctx))
        print(f"{name}: {sum(counter.ops.values())} aten ops")


if __name__ == "__main__":
    main()
