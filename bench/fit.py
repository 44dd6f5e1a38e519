"""`alchemist bench training --max-fit`: the longest trained length each path fits on the device.

For each path on its own, lengths are tried in increasing order until one runs out of
device memory (paper: DPO on Llama-3.1-8B, 80 GB: about 3,000 tokens for the separate
trainer, 7,000 for alchemist):
  - reuse: the prompt is served recorded, then trained from its recording;
  - recompute: the entry holds tokens only (nothing recorded) and the separate trainer
    trains from them (the method's `baseline_job`: TRL's layout).
Both share the model, its KV cache and the adapter, so the difference is the training
activations. DPO here takes both responses as given (N/4 tokens each, nothing decoded),
so that a 16k-token attempt does not decode 4k tokens first.
"""

from __future__ import annotations

import gc
import time

import torch

from bench.traces import synthetic_tokens
from engine.model_runner import run_to_end
from trainer.entries import EntryState, PreferenceLabel

PATHS = ("reuse", "recompute")


def _attempt(bench, mode: str, tokens: int, path: str) -> int:
    """Trains one entry of `tokens` trained tokens on `path`; its peak device bytes."""
    prompt_len = tokens if mode == "cpt" else tokens // 2
    prompt = synthetic_tokens(bench.tokenizer, prompt_len, tokens)
    request_id = f"fit-{path}-{tokens}-{time.monotonic_ns()}"
    torch.cuda.reset_peak_memory_stats()
    entry = None
    try:
        if path == "reuse":
            bench.serve(prompt, True, request_id)
            entry = bench.trainer.cache.get(request_id)
            if entry is None or entry.recording is None:
                raise RuntimeError(f"the {tokens}-token prompt was not recorded")
        else:
            entry = bench.method.make_label_entry(request_id, prompt, bench.trainer.optimizer.version)
        if mode == "dpo":
            response_len = tokens // 4
            eos = [bench.tokenizer.eos_token_id]
            entry.label = PreferenceLabel(synthetic_tokens(bench.tokenizer, response_len - 1, 1) + eos,
                                          synthetic_tokens(bench.tokenizer, response_len - 1, 2) + eos)
            entry.reference_logps = run_to_end(bench.method.reference_logps(entry, bench.context))
        job = bench.method.reuse_job(entry, bench.context) if path == "reuse" else \
            bench.method.baseline_job(entry, bench.context)
        bench.trainer.optimizer.zero_grad()
        run_to_end(job)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    finally:
        bench.trainer.optimizer.zero_grad()
        if entry is not None and bench.trainer.cache.get(entry.completion_id) is entry:
            bench.trainer.cache.end(entry, EntryState.DROPPED)
        elif entry is not None:
            entry.release()
        for unfinished in bench.engine.request_ids():  # a prefill that ran out of memory
            bench.engine.abort_request(unfinished)
        gc.collect()
        torch.cuda.empty_cache()


def longest_fit(bench, mode: str, lengths: list[int]) -> dict:
    """{path: {"max_tokens", "peak_bytes" at it, "failed_at"}} over increasing `lengths`."""
    if not torch.cuda.is_available():
        raise SystemExit("--max-fit measures device memory: it needs a CUDA device")
    report = {}
    for path in PATHS:
        best, peak, failed_at = None, None, None
        for tokens in sorted(lengths):
            try:
                peak_bytes = _attempt(bench, mode, tokens, path)
            except torch.OutOfMemoryError:
                failed_at = tokens
                print(f"  fit {mode} {path:9s} {tokens:6d} tokens: out of memory", flush=True)
                break
            best, peak = tokens, peak_bytes
            print(f"  fit {mode} {path:9s} {tokens:6d} tokens: fits, peak {peak_bytes / 2**30:.1f} GiB", flush=True)
        report[path] = {"max_tokens": best, "peak_bytes": peak, "failed_at": failed_at}
    report["device_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return report
