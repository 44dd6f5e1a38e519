"""`alchemist bench recording`: what recording costs a short prefill, by what happens to
the recordings before it.

On the embedded model, DPO mode, one prompt of `--tokens` tokens at a time, plain and
recorded in alternating order, the trainer's idle slices run between requests; the figure is the time to the first token (the prefill
step), recorded over plain, per case:
  - `kept_cold`: every recording stays alive (entries waiting for labels that never
    come), without the trainer's pre-faulted heap (engine/malloc_tuning.HeapWarmer);
  - `kept`: the same, with it;
  - `freed`: each recording is dropped before the next request (its memory is reused);
  - `trained`: each recording is labelled and trained before the next request (what a
    client that sends feedback at once causes);
  - `beside_decodes`: as `trained`, with three other requests decoding when the prompt
    arrives, so its prefill shares a step with their decodes (the common case under
    traffic); the figure is that step's time, recorded over plain.
"""

from __future__ import annotations

import statistics
import time

from bench.report import write_json
from bench.traces import synthetic_tokens
from engine.llm_engine import LLMEngine
from engine.malloc_tuning import keep_freed_memory
from engine.model_loader import load
from engine.sampling_params import SamplingParams
from server.build import build_training_engine
from server.config import AlchemistConfig
from trainer.entries import EntryState
from trainer.config import TrainConfig
from trainer.feedback import FeedbackLabel

CASES = ("kept_cold", "kept", "freed", "trained", "beside_decodes")
_DECODES = 3


def _first_token_seconds(engine: LLMEngine, request_id: str, prompt: list[int], train: bool,
                         decodes: int = 0) -> float:
    """The first step's time (the prompt's prefill, beside `decodes` decoding requests)."""
    for d in range(decodes):  # prefilled first, so that they decode when the prompt arrives
        engine.add_request(f"{request_id}-decode{d}", prompt[: len(prompt) // 2 + d],
                           SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        engine.step()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=8, temperature=0.0), train=train)
    started, first = time.perf_counter(), None
    while engine.has_unfinished():
        engine.step()
        if first is None:
            first = time.perf_counter() - started
            for d in range(decodes):
                engine.abort_request(f"{request_id}-decode{d}")
    return first


def measure_case(config: AlchemistConfig, case: str, tokens: int, repeats: int) -> dict:
    model, tokenizer, _ = load(config.model)
    engine, trainer = build_training_engine(model, tokenizer, config, TrainConfig(mode="dpo"),
                                            heap_warming=case != "kept_cold")
    trainer.maintenance.merge_all()
    seconds = {True: [], False: []}
    for i in range(repeats + 2):  # the first two rounds warm up
        for recorded in ((True, False) if i % 2 else (False, True)):
            request_id = f"{case}-{i}-{recorded}"
            took = _first_token_seconds(engine, request_id, synthetic_tokens(tokenizer, tokens, i), recorded,
                                        _DECODES if case == "beside_decodes" else 0)
            if recorded and case == "freed":
                trainer.cache.end(trainer.cache.get(request_id), EntryState.DROPPED)
            elif recorded and case in ("trained", "beside_decodes"):
                trainer.feedback.submit(FeedbackLabel(request_id, "A short and friendly answer.", None, 0))
            trainer.train_until_idle()  # the server's idle gap
            if i >= 2:
                seconds[recorded].append(took)
    ratio = statistics.median(seconds[True]) / statistics.median(seconds[False])
    print(f"  {case:8s} {tokens} tokens: recorded prefill x{ratio:.2f} "
          f"(recorded {[round(s * 1000) for s in seconds[True]]} ms, plain {[round(s * 1000) for s in seconds[False]]} ms)",
          flush=True)
    return {"case": case, "tokens": tokens, "ratio": round(ratio, 3), "recorded_s": seconds[True],
            "plain_s": seconds[False]}


def run_recording_bench(config: AlchemistConfig, tokens: int, repeats: int, json_path: str | None = None) -> dict:
    keep_freed_memory()  # as the server does
    report = {"tokens": tokens, "repeats": repeats, "cases": [measure_case(config, c, tokens, repeats) for c in CASES]}
    write_json(report, json_path)
    return report
