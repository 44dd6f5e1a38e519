"""A recorded prefill (100 tokens, DPO) right after the adapter changed, with the merged
serving weights rebuilt first (`current`) or not yet (`stale`: it runs the unmerged path),
alternating. Where the server's recorded prefills cost more under the trace than
`bench recording` measures, this is one candidate. Run from the repository root:

    .venv/bin/python docs/training-issue24/stale_merged_prefill.py
"""

import statistics
import time

import torch

from bench.recording import embedded_training_engine
from bench.traces import synthetic_tokens
from engine.malloc_tuning import keep_freed_memory
from engine.sampling_params import SamplingParams
from server.config import load_config
from trainer.adapter import lora_parameters
from trainer.entries import EntryState


def main() -> None:
    keep_freed_memory()
    engine, trainer, tokenizer = embedded_training_engine(load_config(None))
    params = lora_parameters(trainer.peft_model)

    def recorded_prefill(index: int) -> float:
        request_id = f"r{index}"
        engine.add_request(request_id, synthetic_tokens(tokenizer, 100, index),
                           SamplingParams(max_tokens=1, temperature=0.0), train=True)
        started = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - started
        while engine.has_unfinished():
            engine.step()
        entry = trainer.cache.get(request_id)
        if entry is not None:
            trainer.cache.end(entry, EntryState.DROPPED)
        return seconds

    seconds = {"current": [], "stale": []}
    for i in range(16):  # the first two rounds warm up
        for state in (("stale", "current") if i % 2 else ("current", "stale")):
            with torch.no_grad():
                for p in params:
                    p.add_(torch.randn_like(p) * 1e-4)  # what an optimizer step changes
            trainer.maintenance.invalidate_merged()
            if state == "current":
                trainer.maintenance.merge_all()
            took = recorded_prefill(2 * i + (state == "stale"))
            if i >= 2:
                seconds[state].append(took)
    medians = {k: statistics.median(v) for k, v in seconds.items()}
    print({k: round(v * 1000, 1) for k, v in medians.items()}, "stale / current",
          round(medians["stale"] / medians["current"], 3))


if __name__ == "__main__":
    main()
