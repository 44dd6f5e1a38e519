"""A serving step whose prefills start at different positions, with the prefills going on from
earlier tokens in an attention group of their own (engine/step_inputs.py, `attention_kinds`)
against the layout before, where every prefill shared one group, padded to the longest's
queries. Alternating rounds in one process, the embedded model:

  - `burst`: 8 prompts sharing a 1,000-token beginning admitted in one step: the first
    computes all of its 1,032 tokens, the 7 others their last 40 after the cached beginning;
  - `chunk`: a prompt's next 64-token chunk (from position 960) beside a new 300-token prompt.

    PYTHONPATH=. .venv/bin/python docs/prefix-cache-2026-12-01/group_split_ab.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import engine.step_inputs as step_inputs
from bench.traces import synthetic_tokens
from engine.llm_engine import LLMEngine
from engine.model_loader import load
from engine.sampling_params import SamplingParams
from server.config import load_config

SPLIT = step_inputs.attention_kinds


def one_group(members: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> list[np.ndarray]:
    """The layout before: decodes apart, every prefill in one group."""
    return [members[lengths[members] == 1], members[lengths[members] > 1]]


def first_step_seconds(engine: LLMEngine, prompts: list[list[int]], tag: str, chunk_first: int = 0) -> float:
    """The seconds of the step that prefills `prompts` (after `chunk_first` tokens of the first
    were computed by a step before), then the requests run out."""
    params = SamplingParams(temperature=0.0, max_tokens=2, min_tokens=2)
    if chunk_first:
        engine.add_request(f"{tag}-0", prompts[0], params)
        budget = engine.scheduler.config
        engine.scheduler.config = type(budget)(**{**budget.__dict__, "max_num_batched_tokens": chunk_first})
        engine.step()
        engine.scheduler.config = budget
    for i, prompt in enumerate(prompts[1:] if chunk_first else prompts):
        engine.add_request(f"{tag}-{i + 1}", prompt, params)
    started = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - started
    while engine.has_unfinished():
        engine.step()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    config = load_config()
    model, tokenizer, _ = load(config.model)
    engine = LLMEngine.for_model(model, tokenizer, config)
    cases = {
        "burst": lambda r: ([synthetic_tokens(tokenizer, 1000, 3 * r + 1) + synthetic_tokens(tokenizer, 32, 50 + i)
                             for i in range(8)], 0),
        "chunk": lambda r: ([synthetic_tokens(tokenizer, 1024, 3 * r + 2), synthetic_tokens(tokenizer, 300, r)], 960),
    }
    seconds = {case: {"split": [], "one_group": []} for case in cases}
    first_step_seconds(engine, [synthetic_tokens(tokenizer, 64, 999)], "warm-up")
    for r in range(args.rounds):
        for case, make in cases.items():
            prompts, chunk_first = make(r)
            for layout in (("split", "one_group") if r % 2 == 0 else ("one_group", "split")):
                step_inputs.attention_kinds = SPLIT if layout == "split" else one_group
                engine.scheduler.allocator.forget_names()  # each layout computes the same blocks
                seconds[case][layout].append(first_step_seconds(engine, prompts, f"{case}-{r}-{layout}", chunk_first))
            print(case, r, {k: round(v[-1], 3) for k, v in seconds[case].items()}, flush=True)
    step_inputs.attention_kinds = SPLIT
    result = {case: {"median_s": {k: round(statistics.median(v), 3) for k, v in by.items()},
                     "one_group_over_split": round(statistics.median(by["one_group"]) / statistics.median(by["split"]),
                                                   2)}
              for case, by in seconds.items()}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "result": result, "seconds": seconds}, f, indent=1)


if __name__ == "__main__":
    main()
