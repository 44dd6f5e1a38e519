"""`alchemist bench serving --n N`: one request with n choices on a long prompt, forked
(one prefill for all choices) against the plain path (each choice prefills the prompt),
both against n = 1, side by side in interleaved rounds.

The prompt is `--prompt-tokens` tokens of text; the answer is `--max-tokens` tokens
(short by default: the group's cost is then mostly the prompt's). The choices sample at
temperature 1 with a seed, so the forked and plain paths must produce the same tokens.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

from bench.report import write_json
from bench.traces import synthetic_tokens
from engine.llm_engine import LLMEngine
from engine.model_loader import load
from engine.sampling_params import SamplingParams
from server.config import AlchemistConfig


def run_group_serving_bench(config: AlchemistConfig, n: int, prompt_tokens: int = 1000, max_tokens: int = 16,
                            repeats: int = 3, json_path: str | None = None) -> dict:
    model, tokenizer, name = load(config.model)
    engine = LLMEngine.for_model(model, tokenizer, config)
    plain_config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, fork_choices=False))
    plain = LLMEngine.for_model(model, tokenizer, plain_config)  # the same weights: only the scheduling differs
    prompt = synthetic_tokens(tokenizer, prompt_tokens, 0)
    group = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=max_tokens, min_tokens=max_tokens)
    single = dataclasses.replace(group, n=1)
    runs = {"n1": lambda: engine.generate([prompt], single)[0],
            "forked": lambda: engine.generate([prompt], group)[0],
            "per_choice": lambda: plain.generate([prompt], group)[0]}
    engine.generate([prompt[:64]], dataclasses.replace(group, max_tokens=2, min_tokens=2))  # warm-up
    seconds: dict[str, list[float]] = {key: [] for key in runs}
    outputs = {}
    for round_index in range(repeats):
        for key, fn in runs.items():
            started = time.perf_counter()
            outputs[key] = fn()
            seconds[key].append(time.perf_counter() - started)
            print(f"round {round_index + 1}/{repeats}  {key:<11} {seconds[key][-1]:7.2f} s", flush=True)
    median = {key: statistics.median(values) for key, values in seconds.items()}
    result = {
        "model": name,
        "n": n,
        "prompt_tokens": len(prompt),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "seconds": {key: round(value, 3) for key, value in median.items()},
        "seconds_all_rounds": {key: [round(v, 3) for v in values] for key, values in seconds.items()},
        # the goal: forked n over n = 1 at most 2
        "ratio_forked_over_n1": round(median["forked"] / median["n1"], 3),
        "ratio_per_choice_over_n1": round(median["per_choice"] / median["n1"], 3),
        "speedup_forked_over_per_choice": round(median["per_choice"] / median["forked"], 3),
        "forked_equal_to_per_choice": outputs["forked"] == outputs["per_choice"],
    }
    print(json.dumps(result, indent=2))
    write_json(result, json_path)
    return result
