"""The recorded prefill's cost to the host, where a GPU waits for it: a tiny Llama in
bfloat16 (hidden 16, so that compute is negligible) with as many decoder layers as
Llama-3.1-8B (32), LoRA on every linear, DPO mode with the LoRA math in the model's dtype
(the GPU's path: serving and training copies). A 52-token prompt is prefilled recorded
(`train=True`) and plain, alternating; reported: the Python function calls of each step
(counted by cProfile: the same on every machine) and the median step time of each over
the rounds, with their ratio (this CPU's times: a proxy for the GPU's host time; on
this model the recorded step read 1.9–2.0x a plain one, where `bench training`'s
recording column read 1.97–2.22x for DPO's prompts on the H100 at the 8B shape). On this
CPU, unlike a GPU, the recorded step also decomposes RMSNorm under autograd. With
`--float32` the model is float32 and takes the CPU's path (merged weights).
Run from the repository root (and in a worktree of an older tree to compare):

    PYTHONPATH=. .venv/bin/python docs/training-issue24/recorded_prefill_host.py [--rounds 15] [--float32]
"""

import argparse
import cProfile
import pstats
import statistics

import torch

from host_proxy import host_proxy_engine, timed_prefill
from tests.conftest import encode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--float32", action="store_true", help="the CPU's merged path, not the GPU's copies")
    args = parser.parse_args()
    engine, _ = host_proxy_engine(torch.float32 if args.float32 else torch.bfloat16)
    ids = encode("Online learning trains a LoRA adapter on what the server just served. " * 2)
    counter = iter(range(1 << 30))

    def prefill(recorded: bool, profile: cProfile.Profile | None = None) -> float:
        return timed_prefill(engine, ids, f"r{next(counter)}", recorded, profile=profile)

    for _ in range(3):  # warm-up: the copies, the caches, the allocator
        prefill(True)
        prefill(False)
    calls = {}
    for recorded in (True, False):
        profile = cProfile.Profile()
        prefill(recorded, profile)
        calls[recorded] = sum(stat[1] for stat in pstats.Stats(profile).stats.values())
    seconds = {True: [], False: []}
    for _ in range(args.rounds):
        for recorded in (True, False):
            seconds[recorded].append(prefill(recorded))
    recorded_ms, plain_ms = (statistics.median(seconds[k]) * 1e3 for k in (True, False))
    print(f"Python calls per step: recorded {calls[True]:,}, plain {calls[False]:,}")
    print(f"median step: recorded {recorded_ms:.1f} ms, plain {plain_ms:.1f} ms, "
          f"recorded / plain {recorded_ms / plain_ms:.2f}x")


if __name__ == "__main__":
    main()
