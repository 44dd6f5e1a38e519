"""Serving steps on the embedded model in their layouts, side by side in one process, in
alternating rounds; each figure is a layout's median step time against the plain one's.

- `--tokens`: a prefill step of that many prompt tokens, alone and beside three decoding
  requests, in four layouts: the groups bucketed (a GPU's shapes) or exact (the CPU's
  default), attention reading a mask or running SDPA's causal kernel (the default where
  every sequence starts at position 0). Plain: bucketed, mask.
- `--decodes STREAMS:CONTEXT …`: a decode-only step of that many streams at about that
  context, bucketed (rows padded to a power of two, keys to a bucket) or exact. Plain:
  bucketed.

Run from the repository root:

    .venv/bin/python docs/training-issue24/serving_step_layouts.py --tokens 100 300 1000 --rounds 7 --json …
    .venv/bin/python docs/training-issue24/serving_step_layouts.py --tokens --decodes 8:100 8:300 5:300 3:600 --json …
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.traces import synthetic_tokens  # noqa: E402
from engine.kv_cache import AttentionGroup  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_loader import load  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from server.config import AlchemistConfig  # noqa: E402

LAYOUTS = {"bucketed+mask": (False, False), "bucketed+causal": (False, True), "exact+mask": (True, False),
           "exact+causal": (True, True)}
_RUNS_CAUSAL = AttentionGroup.runs_causal
_DECODES = 3
_DECODE_STEPS = 30


def use_layout(engine: LLMEngine, layout: str) -> None:
    exact, causal = LAYOUTS[layout]
    engine.runner.exact_shapes = exact
    AttentionGroup.runs_causal = _RUNS_CAUSAL if causal else (lambda self, sliding_window=None: False)


def clear(engine: LLMEngine) -> None:
    for request_id in engine.request_ids():
        engine.abort_request(request_id)
    while engine.has_unfinished():
        engine.step()


def prefill_seconds(engine: LLMEngine, prompt: list[int], decodes: int, tag: str) -> float:
    """The step that prefills `prompt`, beside `decodes` requests already decoding."""
    for d in range(decodes):
        engine.add_request(f"{tag}-d{d}", prompt[: 20 + d], SamplingParams(max_tokens=64, temperature=0.0,
                                                                          ignore_eos=True))
        engine.step()
    engine.add_request(tag, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    started = time.perf_counter()
    engine.step()
    took = time.perf_counter() - started
    clear(engine)
    return took


def decode_seconds(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    """The median of `_DECODE_STEPS` decode-only steps of `prompts`, all prefilled first."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=_DECODE_STEPS + 8, temperature=0.0,
                                                                ignore_eos=True))
    while engine.scheduler.waiting or any(seq.num_pending_tokens > 1 for seq in engine.scheduler.running):
        engine.step()
    steps = []
    for _ in range(_DECODE_STEPS):
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    clear(engine)
    return statistics.median(steps)


def compare(measure, layouts: list[str], rounds: int) -> dict:
    """Each layout's median over `rounds` alternating rounds (one more first, to warm up),
    and the plain one's (the first) over each."""
    seconds = {layout: [] for layout in layouts}
    for r in range(rounds + 1):
        for layout in (layouts if r % 2 else list(reversed(layouts))):
            took = measure(layout, r)
            if r:
                seconds[layout].append(took)
    medians = {layout: statistics.median(s) for layout, s in seconds.items()}
    return {"median_ms": {k: round(v * 1e3, 1) for k, v in medians.items()},
            "plain_over": {k: round(medians[layouts[0]] / v, 3) for k, v in medians.items()}, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="*", default=[100, 300, 1000])
    parser.add_argument("--decodes", nargs="*", default=[], metavar="STREAMS:CONTEXT")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    config = AlchemistConfig()
    model, tokenizer, _ = load(config.model)
    engine = LLMEngine.for_model(model, tokenizer, config)
    report = {"threads": torch.get_num_threads(), "rounds": args.rounds, "prefill": [], "decode": []}

    def prefill(tokens: int, decodes: int):
        def measure(layout: str, r: int) -> float:
            use_layout(engine, layout)
            return prefill_seconds(engine, synthetic_tokens(tokenizer, tokens, r), decodes,
                                   f"{tokens}-{decodes}-{r}-{layout}")
        return measure

    def decode(streams: int, context: int):
        def measure(layout: str, r: int) -> float:
            use_layout(engine, layout)
            prompts = [synthetic_tokens(tokenizer, context + 3 * i, r * 100 + i) for i in range(streams)]
            return decode_seconds(engine, prompts, f"decode-{streams}-{context}-{r}-{layout}")
        return measure

    for tokens in args.tokens:
        for decodes in (0, _DECODES):
            case = {"tokens": tokens, "decodes": decodes, **compare(prefill(tokens, decodes), list(LAYOUTS),
                                                                    args.rounds)}
            report["prefill"].append(case)
            print(f"prefill {tokens:5d} tokens, {decodes} decodes: " + ", ".join(
                f"{k} {case['median_ms'][k]} ms (x{case['plain_over'][k]:.2f})" for k in LAYOUTS), flush=True)
    for spec in args.decodes:
        streams, context = (int(part) for part in spec.split(":"))
        case = {"streams": streams, "context": context,
                **compare(decode(streams, context), ["bucketed+causal", "exact+causal"], args.rounds)}
        report["decode"].append(case)
        print(f"decode {streams} streams at {context} tokens: " + ", ".join(
            f"{k} {v} ms (x{case['plain_over'][k]:.2f})" for k, v in case["median_ms"].items()), flush=True)
    use_layout(engine, "exact+causal")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
