"""Recorded prefills with and without the saved-tensor hooks, in one process, alternating
(engine/saved_bytes_memo.py): on the host-cost model (host_proxy.py: a 32-layer tiny
bfloat16 Llama on the GPU's code path, where the host is what a GPU waits for), the
runner's memo is switched on and off between rounds. Reported, for each way: the Python
calls of a recorded prefill step and of the DPO reuse job on such a recording (cProfile:
the same on every machine), and the median seconds of each over the rounds, beside a
plain prefill and the recompute job. Run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/training-issue24/recording_hooks_ab.py [--rounds 12]
"""

import argparse
import cProfile
import pstats
import statistics
import time

from dpo_job_host import CHOSEN, PROMPT, REJECTED
from engine.model_runner import run_to_end
from host_proxy import host_proxy_engine, timed_prefill
from tests.conftest import encode
from trainer.entries import EntryState
from trainer.feedback import FeedbackLabel

WAYS = ("without hooks", "with hooks")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    engine, trainer = host_proxy_engine()
    memo = engine.runner.saved_bytes_memo
    ids = encode(PROMPT)
    counter = iter(range(1 << 30))

    def prefill(way: str | None, profile: cProfile.Profile | None = None) -> tuple[float, str]:
        """Serves the prompt (recorded unless `way` is None); -> (prefill step's seconds, request id)."""
        engine.runner.saved_bytes_memo = memo if way == WAYS[0] else None
        request_id = f"r{next(counter)}"
        seconds = timed_prefill(engine, ids, request_id, way is not None, max_tokens=4, profile=profile)
        engine.runner.saved_bytes_memo = memo
        return seconds, request_id

    def job(way: str, path: str, profile: cProfile.Profile | None = None) -> float:
        """Records the prompt `way`, labels it and runs `path`'s job on it; -> the job's seconds."""
        _, request_id = prefill(way)
        assert trainer.feedback.submit(FeedbackLabel(request_id, CHOSEN, REJECTED, 0)).accepted
        entry = trainer.cache.get(request_id)
        work = (trainer.method.reuse_job if path == "reuse" else trainer.method.baseline_job)(entry, trainer.context)
        if profile is not None:
            profile.enable()
        started = time.perf_counter()
        run_to_end(work)
        seconds = time.perf_counter() - started
        if profile is not None:
            profile.disable()
        trainer.optimizer.zero_grad()
        trainer.cache.end(entry, EntryState.TRAINED)
        return seconds

    def calls(run) -> int:
        profile = cProfile.Profile()
        run(profile)
        return sum(stat[1] for stat in pstats.Stats(profile).stats.values())

    for way in (*WAYS, None):  # warm-up: the copies, the caches, the allocator, the memo's first measurement
        prefill(way)
        if way is not None:
            job(way, "reuse")
    job(WAYS[0], "recompute")
    for way in WAYS:
        print(f"{way}: Python calls per recorded prefill step {calls(lambda p: prefill(way, p)):,}, "
              f"per DPO reuse job {calls(lambda p: job(way, 'reuse', p)):,}")
    print(f"plain prefill step {calls(lambda p: prefill(None, p)):,}, DPO recompute job "
          f"{calls(lambda p: job(WAYS[0], 'recompute', p)):,}")
    steps = {way: [] for way in (*WAYS, "plain")}
    jobs = {way: [] for way in (*WAYS, "recompute")}
    for r in range(args.rounds):
        order = (*WAYS, None) if r % 2 == 0 else (None, *reversed(WAYS))
        for way in order:
            steps[way or "plain"].append(prefill(way)[0])
            jobs[way or "recompute"].append(job(way or WAYS[0], "reuse" if way else "recompute"))
    step = {k: statistics.median(v) * 1e3 for k, v in steps.items()}
    work = {k: statistics.median(v) * 1e3 for k, v in jobs.items()}
    for way in WAYS:
        print(f"{way}: recorded prefill {step[way]:.1f} ms ({step[way] / step['plain']:.2f}x plain {step['plain']:.1f}),"
              f" DPO reuse job {work[way]:.0f} ms (recompute / reuse {work['recompute'] / work[way]:.2f}x)")
    print(f"with hooks / without: recorded prefill {step[WAYS[1]] / step[WAYS[0]]:.3f}x, "
          f"reuse job {work[WAYS[1]] / work[WAYS[0]]:.3f}x")


if __name__ == "__main__":
    main()
