"""A recorded prefill against a plain prefill of the same prompt, in one DPO training
engine, alternating, with the page faults each step took. Between rounds the trainer
runs a fixed number of items that do not finish its jobs (`--slices`, as the server's
gaps under a backlog), or trains to idle (`--slices 0`). With `--device-thread` the
steps and items run on a second thread, as the server's device thread runs them (its
allocations come from a glibc arena of its own); `--piece-kib` sets the size of the warm
heap's pieces, instead of the size of the largest tensor the largest recording saved
(engine/malloc_tuning.py). Run from the repository root:

    .venv/bin/python docs/training-issue24/recorded_prefill_under_backlog.py --slices 60
    .venv/bin/python docs/training-issue24/recorded_prefill_under_backlog.py --slices 0
    PYTHONPATH=. .venv/bin/python docs/training-issue24/recorded_prefill_under_backlog.py --slices 60 \
        --device-thread [--piece-kib 16384]
"""

import argparse
import concurrent.futures
import gc
import json
import statistics
import time

from bench.recording import embedded_training_engine
from bench.traces import synthetic_tokens
import engine.malloc_tuning as malloc_tuning
from engine.malloc_tuning import keep_freed_memory, minor_page_faults
from engine.sampling_params import SamplingParams
from server.config import load_config
from trainer.feedback import FeedbackLabel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=100, help="prompt tokens")
    parser.add_argument("--slices", type=int, default=60, help="training items per round; 0: train to idle")
    parser.add_argument("--device-thread", action="store_true", help="steps and items on a second thread")
    parser.add_argument("--piece-kib", type=int, default=None, help="the warm heap's pieces, all of this size")
    args = parser.parse_args()
    keep_freed_memory()
    if args.piece_kib:
        fit = malloc_tuning.HeapWarmer.fit

        def fit_in_pieces_of_one_size(warmer, sizes):
            fit(warmer, sizes)
            warmer.piece_bytes = args.piece_kib << 10

        malloc_tuning.HeapWarmer.fit = fit_in_pieces_of_one_size
    engine, trainer, tokenizer = embedded_training_engine(load_config(None))
    gc.collect()
    gc.freeze()  # as the server does (server/gc_freeze.py)

    def prefill(request_id: str, prompt: list[int], record: bool) -> tuple[float, int]:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0),
                           train=record)
        faults, started = minor_page_faults(), time.perf_counter()
        engine.step()
        seconds, faults = time.perf_counter() - started, minor_page_faults() - faults
        while engine.has_unfinished():
            engine.step()
        return seconds, faults

    seconds, faults = {"plain": [], "recorded": []}, {"plain": [], "recorded": []}

    def rounds():
        for i in range(args.rounds):
            one_round(i)

    def one_round(i: int) -> None:
        for _ in range(args.slices):
            trainer.run_slice()
        prompt = synthetic_tokens(tokenizer, args.tokens, i)
        for record in ((False, True) if i % 2 else (True, False)):
            took, faulted = prefill(f"r{i}-{record}", prompt, record)
            if i >= 2:  # the first two rounds warm up
                name = "recorded" if record else "plain"
                seconds[name].append(took)
                faults[name].append(faulted)
        trainer.feedback.submit(FeedbackLabel(f"r{i}-True", "A short and friendly answer.", None, 0))
        if not args.slices:
            trainer.train_until_idle()

    if args.device_thread:
        with concurrent.futures.ThreadPoolExecutor(1) as device:
            device.submit(rounds).result()
    else:
        rounds()
    median_ms = {name: statistics.median(values) * 1000 for name, values in seconds.items()}
    print(json.dumps({"slices": args.slices, "device_thread": args.device_thread,
                      "pieces": f"{args.piece_kib} KiB" if args.piece_kib else "its largest tensor's size",
                      **{f"{k}_ms": round(v, 1) for k, v in median_ms.items()},
                      "recorded_over_plain": round(median_ms["recorded"] / median_ms["plain"], 3),
                      **{f"{k}_page_faults": statistics.median(v) for k, v in faults.items()},
                      "entries_waiting": len(list(trainer.cache.entries())),
                      "adapter_version": trainer.optimizer.version}))


if __name__ == "__main__":
    main()
