"""DPO's base reference on the host-cost model (host_proxy.py: 32 layers, bfloat16, compute
negligible — the GPU's code path, where the host is what a GPU waits for): its aten ops
(each a kernel launch on a GPU), its Python calls (cProfile) and its median time over
rounds, for one labelled entry. Every DPO job computes its entry's reference once, the
reuse job and the recompute job alike. Run from the repository root, and in a worktree
of an older tree to compare (alternating):

    PYTHONPATH=.:docs/training-issue24 .venv/bin/python docs/training-issue24/reference_host.py [--rounds 15]
"""

import argparse
import cProfile
import pstats
import statistics
import time

from bench.step_counts import AtenOps
from engine.model_runner import run_to_end
from engine.sampling_params import SamplingParams
from host_proxy import host_proxy_engine
from tests.conftest import encode
from trainer.feedback import FeedbackLabel

PROMPT = "Online learning trains a LoRA adapter on what the server just served. " * 2
CHOSEN = "It reuses the activations that the serving prefill computed."
REJECTED = "It recomputes every activation in a separate training cluster."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    engine, trainer = host_proxy_engine()
    engine.add_request("r", encode(PROMPT), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       train=True)
    while engine.has_unfinished():
        engine.step()
    assert trainer.feedback.submit(FeedbackLabel("r", CHOSEN, REJECTED, 0)).accepted
    entry, ctx = trainer.cache.get("r"), trainer.context

    def reference():
        return run_to_end(trainer.method.reference_logps(entry, ctx))

    values = reference()  # and a warm-up
    ops = AtenOps()
    with ops.counting():
        reference()
    profile = cProfile.Profile()
    profile.enable()
    reference()
    profile.disable()
    calls = sum(stat[1] for stat in pstats.Stats(profile).stats.values())
    seconds = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        reference()
        seconds.append(time.perf_counter() - started)
    print(f"reference (chosen, rejected) = ({values[0]:.4f}, {values[1]:.4f}): {ops.total:,} aten ops, "
          f"{calls:,} Python calls, median {statistics.median(seconds) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
