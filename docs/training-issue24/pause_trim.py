"""The recorded prefill that ends a pause in traffic, after a pause that gave freed memory
back to the OS (`malloc_trim`, what every pause did before `train.trim_slack_mib`), after
one that kept it (the default, within the slack), and after a trim followed by warming
the heap again (what a pause's trim does now), in turn, in one DPO training engine on the
embedded model, every step on a second thread as the server's device thread. Each round
trains the last label, warms the heap as the idle server does, then (in the trimmed
rounds) releases the warm heap and gives freed memory back, warming it again in the
rewarmed rounds, then records a 100-token prompt: its step's time and page faults. Run
from the repository root:

    PYTHONPATH=. .venv/bin/python docs/training-issue24/pause_trim.py [--rounds 15]
"""

import argparse
import concurrent.futures
import gc
import statistics
import time

from bench.recording import embedded_training_engine
from bench.traces import synthetic_tokens
from engine.malloc_tuning import keep_freed_memory, minor_page_faults, return_freed_memory
from engine.sampling_params import SamplingParams
from server.config import load_config
from trainer.feedback import FeedbackLabel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=100)
    args = parser.parse_args()
    keep_freed_memory()
    device = concurrent.futures.ThreadPoolExecutor(1)

    def on_device(function, *arguments):
        return device.submit(function, *arguments).result()

    engine, trainer, tokenizer = on_device(embedded_training_engine, load_config(None))
    gc.collect()
    gc.freeze()  # as the server does (server/gc_freeze.py)
    warmer = trainer.maintenance.warmer

    def recorded_prefill(request_id: str, prompt: list[int]) -> tuple[float, int]:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0), train=True)
        faults, started = minor_page_faults(), time.perf_counter()
        engine.step()
        seconds, faults = time.perf_counter() - started, minor_page_faults() - faults
        while engine.has_unfinished():
            engine.step()
        return seconds, faults

    def train_and_warm() -> None:
        trainer.train_until_idle()
        while warmer.wants_to_grow():
            warmer.grow()

    def trim(warm_again: bool) -> None:
        warmer.release()
        return_freed_memory()
        while warm_again and warmer.wants_to_grow():
            warmer.grow()

    kinds = ("kept", "trimmed", "rewarmed")
    figures = {kind: ([], []) for kind in kinds}
    for i in range(args.rounds + len(kinds)):
        kind = kinds[i % len(kinds)]
        if kind != "kept":
            on_device(trim, kind == "rewarmed")
        seconds, faults = on_device(recorded_prefill, f"r{i}", synthetic_tokens(tokenizer, args.tokens, i))
        trainer.feedback.submit(FeedbackLabel(f"r{i}", "A short and friendly answer.", None, 0))
        on_device(train_and_warm)
        if i >= len(kinds):  # the first of each warms up
            figures[kind][0].append(seconds)
            figures[kind][1].append(faults)
        print(f"round {i:2d} {kind:8s}: {seconds * 1e3:6.1f} ms, {faults:6d} page faults", flush=True)
    median = {name: (statistics.median(s), statistics.median(f)) for name, (s, f) in figures.items()}
    for name, (seconds, faults) in median.items():
        print(f"{name}: median {seconds * 1e3:.1f} ms, {faults:.0f} page faults per recorded step")
    print(f"after a trim / after a pause within the slack: {median['trimmed'][0] / median['kept'][0]:.3f}x; "
          f"after a trim and warming again / within the slack: {median['rewarmed'][0] / median['kept'][0]:.3f}x")


if __name__ == "__main__":
    main()
