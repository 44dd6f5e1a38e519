"""What the activation cache's per-request questions cost with N answers waiting for
labels: microseconds per call, and a serving step that admits 8 trainable requests, on a
tiny Llama in DPO mode; and the trainer's per-slice and per-step questions (`expire`,
`take_ready`, with nothing expired or ready). Run from the repository root (and on an
older tree to compare):

    PYTHONPATH=. .venv/bin/python docs/training-issue24/cache_questions.py
"""

import statistics
import time

from engine.sampling_params import SamplingParams
from tests.conftest import encode, engine_of, make_training
from trainer.config import TrainConfig
from trainer.entries import EntryState


def microseconds(fn, calls: int = 50) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def admitting_step_ms(engine, trainer, round_index: int) -> float:
    """A prefill step of 8 trainable requests (each asked whether to record it)."""
    for i in range(8):
        engine.add_request(f"s{round_index}-{i}", encode(f"Question {i} of round {round_index}?"),
                           SamplingParams(temperature=0.0, max_tokens=1), train=True)
    started = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - started
    while engine.has_unfinished():
        engine.step()
    return seconds * 1e3


def main() -> None:
    trainer = make_training(TrainConfig(mode="dpo", lora_rank=4, max_staleness=1))
    engine, cache = engine_of(trainer), trainer.cache
    print("| answers waiting for labels | count(ready) | label_entries | has_room_for | lag_of_next_recording "
          "| a step admitting 8 requests | expire | take_ready |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for waiting in (0, 1_000, 10_000):
        while cache.count(EntryState.WAITING_LABEL) < waiting:
            completion_id = f"label-{len(cache)}"
            if not cache.add(trainer.method.make_label_entry(completion_id, [3, 4, 5], 0)):
                break  # train.max_label_entries
            cache.response_finished(completion_id, {0: [6, 7]}, aborted=False)  # waits the label timeout
        steps = [admitting_step_ms(engine, trainer, r) for r in range(5)]
        print(f"| {waiting:,} | {microseconds(lambda: cache.count(EntryState.READY)):,.0f} µs "
              f"| {microseconds(lambda: cache.label_entries):,.0f} µs "
              f"| {microseconds(lambda: cache.has_room_for(1 << 20)):,.0f} µs "
              f"| {microseconds(lambda: cache.lag_of_next_recording(0, 0, 1, 4)):,.0f} µs "
              f"| {statistics.median(steps):.1f} ms "
              f"| {microseconds(cache.expire):,.0f} µs "
              f"| {microseconds(lambda: cache.take_ready(4, 0, 1, 4)):,.0f} µs |")


if __name__ == "__main__":
    main()
