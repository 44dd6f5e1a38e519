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
    arrives (the common case under traffic). The recorded prefill takes its step alone
    and the decodes the next (`scheduler.recorded_prefill_alone`); a plain prefill
    shares its step with them. The figures: the prompt's first token, and the decodes'
    next token, each recorded over plain;
  - `beside_decodes_shared`: the same with the decodes riding along in the recorded
    prefill's forward (the default).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time

import torch

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

CASES = ("kept_cold", "kept", "freed", "trained", "beside_decodes", "beside_decodes_shared")
_DECODES = 3


def first_token_seconds(engine: LLMEngine, request_id: str, prompt: list[int], train: bool,
                         decodes: int = 0) -> tuple[float, float | None]:
    """From the prompt's arrival: (its first token, the decoding requests' next token), the
    prompt prefilled beside `decodes` decoding requests (None: there were none)."""
    for d in range(decodes):  # prefilled first, so that they decode when the prompt arrives
        engine.add_request(f"{request_id}-decode{d}", prompt[: len(prompt) // 2 + d],
                           SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        engine.step()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=8, temperature=0.0), train=train)
    started, first, decoded = time.perf_counter(), None, None if decodes else 0.0
    while engine.has_unfinished():
        outputs, _ = engine.step()
        now = time.perf_counter() - started
        for output in outputs:
            if output.request_id == request_id and first is None and output.outputs[0].token_ids:
                first = now
            elif output.request_id != request_id and decoded is None and output.outputs[0].token_ids:
                decoded = now
        if first is not None and decoded is not None:
            for d in range(decodes):
                engine.abort_request(f"{request_id}-decode{d}")
    return first, (decoded if decodes else None)


def embedded_training_engine(config: AlchemistConfig, mode: str = "dpo", **options):
    """The configured model (the embedded one by default) served with online training in
    `mode` (`build_training`'s options), its merged serving weights built: (engine,
    training, tokenizer)."""
    model, tokenizer, _ = load(config.model)
    engine, trainer = build_training_engine(model, tokenizer, config, TrainConfig(mode=mode), **options)
    trainer.maintenance.merge_all()
    return engine, trainer, tokenizer


def measure_case(config: AlchemistConfig, case: str, tokens: int, repeats: int) -> dict:
    if case.startswith("beside"):
        config = dataclasses.replace(config, scheduler=dataclasses.replace(
            config.scheduler, recorded_prefill_alone=case == "beside_decodes"))
    engine, trainer, tokenizer = embedded_training_engine(config, heap_warming=case != "kept_cold")
    seconds = {True: [], False: []}
    decoded = {True: [], False: []}
    kept_per_token = []  # the bytes each recording keeps (its saved activations), per prompt token
    for i in range(repeats + 2):  # the first two rounds warm up
        for recorded in ((True, False) if i % 2 else (False, True)):
            request_id = f"{case}-{i}-{recorded}"
            prompt = synthetic_tokens(tokenizer, tokens, i)
            took, decodes_took = first_token_seconds(engine, request_id, prompt, recorded,
                                                      _DECODES if case.startswith("beside") else 0)
            entry = trainer.cache.get(request_id) if recorded else None
            if entry is not None and entry.recording is not None:
                kept_per_token.append(entry.recording.saved_bytes / len(prompt))
            if recorded and case == "freed":
                trainer.cache.end(trainer.cache.get(request_id), EntryState.DROPPED)
            elif recorded and case in ("trained", "beside_decodes", "beside_decodes_shared"):
                trainer.feedback.submit(FeedbackLabel(request_id, "A short and friendly answer.", None, 0))
            trainer.train_until_idle()  # the server's idle gap
            if i >= 2:
                seconds[recorded].append(took)
                if decodes_took is not None:
                    decoded[recorded].append(decodes_took)
    ratio = statistics.median(seconds[True]) / statistics.median(seconds[False])
    report = {"case": case, "tokens": tokens, "ratio": round(ratio, 3), "recorded_s": seconds[True],
              "plain_s": seconds[False],
              "recording_bytes_per_token": round(statistics.median(kept_per_token)) if kept_per_token else None}
    beside = ""
    if decoded[True]:
        report["decodes_ratio"] = round(statistics.median(decoded[True]) / statistics.median(decoded[False]), 3)
        report["decodes_recorded_s"], report["decodes_plain_s"] = decoded[True], decoded[False]
        beside = f"; the decodes' next token x{report['decodes_ratio']:.2f}"
    kept = f", {report['recording_bytes_per_token'] / 1024:.0f} KiB kept per token" if kept_per_token else ""
    print(f"  {case:8s} {tokens} tokens: recorded prefill x{ratio:.2f}{beside}{kept} "
          f"(recorded {[round(s * 1000) for s in seconds[True]]} ms, plain {[round(s * 1000) for s in seconds[False]]} ms)",
          flush=True)
    return report


def run_recording_bench(config: AlchemistConfig, tokens: int, repeats: int, json_path: str | None = None,
                        cases: list[str] | None = None) -> dict:
    unknown = set(cases or ()) - set(CASES)
    if unknown:
        raise SystemExit(f"--cases: unknown {sorted(unknown)}; choose from {', '.join(CASES)}")
    keep_freed_memory()  # as the server does
    report = {"tokens": tokens, "repeats": repeats, "cases": []}
    for case in cases or CASES:
        report["cases"].append(measure_case(config, case, tokens, repeats))
        gc.collect()  # each case's engine (cycles hold it) gone before the next one's loads: one model at a time
        torch.cuda.empty_cache()
    write_json(report, json_path)
    return report
