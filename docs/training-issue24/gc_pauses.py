"""Python's garbage collector under serving and DPO training on the embedded model: the
pause of every collection, by generation, with and without `gc.freeze()` after start-up.
The server's device thread runs serving steps and training slices; a collection that
runs inside one delays every request for its whole length. Run from the repository root:

    .venv/bin/python docs/training-issue24/gc_pauses.py [--freeze]
"""

import argparse
import gc
import json
import statistics
import time

from bench.recording import embedded_training_engine
from bench.traces import synthetic_tokens
from engine.malloc_tuning import keep_freed_memory
from engine.sampling_params import SamplingParams
from server.config import load_config
from trainer.feedback import FeedbackLabel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--freeze", action="store_true", help="gc.freeze() once the engine is built")
    parser.add_argument("--requests", type=int, default=24)
    args = parser.parse_args()
    keep_freed_memory()
    engine, trainer, tokenizer = embedded_training_engine(load_config(None))
    if args.freeze:
        gc.collect()
        gc.freeze()
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started: list[float] = []

    def timer(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses[info["generation"]].append(time.perf_counter() - started.pop())

    gc.callbacks.append(timer)
    begun = time.perf_counter()
    for i in range(args.requests):  # three at a time, each labelled once answered, trained in the gaps
        ids = [f"r{i}-{j}" for j in range(3)]
        for j, request_id in enumerate(ids):
            engine.add_request(request_id, synthetic_tokens(tokenizer, 60 + 20 * j, 3 * i + j),
                               SamplingParams(max_tokens=24, temperature=1.0, seed=i), train=True)
        while engine.has_unfinished():
            engine.step()
        for request_id in ids:
            trainer.feedback.submit(FeedbackLabel(request_id, "A short and friendly answer.", None, 0))
        trainer.train_until_idle()
    elapsed = time.perf_counter() - begun
    gc.callbacks.remove(timer)
    report = {"freeze": args.freeze, "seconds": round(elapsed, 1), "frozen_objects": gc.get_freeze_count()}
    for generation, values in pauses.items():
        report[f"gen{generation}"] = {"collections": len(values),
                                      "total_ms": round(1000 * sum(values), 1),
                                      "max_ms": round(1000 * max(values, default=0), 1),
                                      "median_ms": round(1000 * statistics.median(values), 2) if values else 0}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
