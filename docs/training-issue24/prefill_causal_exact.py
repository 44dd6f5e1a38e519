"""A serving prefill step on the embedded model, four layouts side by side in one process:
the prefill group bucketed (a GPU's shapes) or exact (the CPU's default), its attention
reading a mask or running SDPA's causal kernel (the default where every sequence starts at
position 0). Per prompt length, alone and beside three decoding requests, in alternating
rounds; the figure is each layout's median step time over the plain one's (bucketed, mask).
Run from the repository root:

    .venv/bin/python docs/training-issue24/prefill_causal_exact.py --tokens 100 300 1000 --rounds 7 --json …
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


def use_layout(engine: LLMEngine, layout: str) -> None:
    exact, causal = LAYOUTS[layout]
    engine.runner.exact_prefill = exact
    AttentionGroup.runs_causal = _RUNS_CAUSAL if causal else (lambda self, sliding_window=None: False)


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
    for request_id in engine.request_ids():
        engine.abort_request(request_id)
    while engine.has_unfinished():
        engine.step()
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    config = AlchemistConfig()
    model, tokenizer, _ = load(config.model)
    engine = LLMEngine.for_model(model, tokenizer, config)
    report = {"threads": torch.get_num_threads(), "rounds": args.rounds, "cases": []}
    for tokens in args.tokens:
        for decodes in (0, _DECODES):
            seconds = {layout: [] for layout in LAYOUTS}
            for r in range(args.rounds + 1):  # the first round warms up
                order = list(LAYOUTS) if r % 2 else list(reversed(LAYOUTS))
                for layout in order:
                    use_layout(engine, layout)
                    took = prefill_seconds(engine, synthetic_tokens(tokenizer, tokens, r), decodes,
                                           f"{tokens}-{decodes}-{r}-{layout}")
                    if r:
                        seconds[layout].append(took)
            medians = {layout: statistics.median(s) for layout, s in seconds.items()}
            plain = medians["bucketed+mask"]
            case = {"tokens": tokens, "decodes": decodes,
                    "median_ms": {k: round(v * 1e3, 1) for k, v in medians.items()},
                    "plain_over": {k: round(plain / v, 3) for k, v in medians.items()}, "seconds": seconds}
            report["cases"].append(case)
            print(f"{tokens:5d} tokens, {decodes} decodes: " + ", ".join(
                f"{k} {case['median_ms'][k]} ms (x{case['plain_over'][k]:.2f})" for k in LAYOUTS), flush=True)
    use_layout(engine, "exact+causal")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
