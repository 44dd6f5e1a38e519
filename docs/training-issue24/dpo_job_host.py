"""The DPO jobs' cost to the host, where a GPU waits for it (on the H100 at the 8B shape
the reuse job's host time was several times its GPU time): a tiny Llama in bfloat16
(hidden 16, so that compute is negligible) with as many decoder layers as Llama-3.1-8B
(32), LoRA on every linear, DPO with the `base` reference and the LoRA math in the
model's dtype (the GPU's path: serving and training copies). Each round serves two
prompts recorded, labels them, and runs the reuse job on one and the recompute job on
the other, alternating which goes first. Reported: the Python function calls of each job
(cProfile: the same on every machine), its aten ops (each a kernel launch on a GPU), and
the median job time over the rounds, with recompute / reuse (this CPU's times: a proxy
for the GPU's host time). Run from the repository root (and in a worktree of an older
tree to compare):

    PYTHONPATH=. .venv/bin/python docs/training-issue24/dpo_job_host.py [--rounds 9]
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
from trainer.entries import EntryState
from trainer.feedback import FeedbackLabel

PROMPT = "Online learning trains a LoRA adapter on what the server just served. " * 2
CHOSEN = "It reuses the activations that the serving prefill computed."
REJECTED = "It recomputes every activation in a separate training cluster."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    engine, trainer = host_proxy_engine()
    ids = encode(PROMPT)
    counter = iter(range(1 << 30))

    def entry():
        request_id = f"r{next(counter)}"
        engine.add_request(request_id, ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), train=True)
        while engine.has_unfinished():
            engine.step()
        assert trainer.feedback.submit(FeedbackLabel(request_id, CHOSEN, REJECTED, 0)).accepted
        return trainer.cache.get(request_id)

    jobs = {"reuse": trainer.method.reuse_job, "recompute": trainer.method.baseline_job}

    def run(path: str, measure=None) -> float:
        served = entry()
        job = jobs[path](served, trainer.context)
        started = time.perf_counter()
        if measure is None:
            run_to_end(job)
        else:
            with measure():
                run_to_end(job)
        seconds = time.perf_counter() - started
        trainer.optimizer.zero_grad()
        trainer.cache.end(served, EntryState.DROPPED)  # its recording's memory back to the cache's budget
        return seconds

    for path in (*jobs, *jobs):  # warm-up: the copies, the caches, the allocator
        run(path)
    calls, ops = {}, {}
    for path in jobs:
        profile = cProfile.Profile()
        run(path, lambda: profile)
        calls[path] = sum(stat[1] for stat in pstats.Stats(profile).stats.values())
        counter_ops = AtenOps()
        run(path, counter_ops.counting)
        ops[path] = counter_ops.total
    seconds = {path: [] for path in jobs}
    for r in range(args.rounds):
        for path in (jobs if r % 2 == 0 else reversed(list(jobs))):
            seconds[path].append(run(path))
    median = {path: statistics.median(s) * 1e3 for path, s in seconds.items()}
    for path in jobs:
        print(f"{path}: {calls[path]:,} Python calls, {ops[path]:,} aten ops, median {median[path]:.1f} ms")
    print(f"recompute / reuse: {median['recompute'] / median['reuse']:.2f}x time, "
          f"reuse / recompute: {ops['reuse'] / ops['recompute']:.2f}x aten ops, "
          f"{calls['reuse'] / calls['recompute']:.2f}x Python calls")


if __name__ == "__main__":
    main()
