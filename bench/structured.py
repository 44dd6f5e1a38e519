"""`alchemist bench structured`: what grammar-constrained decoding costs inside the engine,
against the same batch decoded unconstrained, side by side in interleaved rounds.

A batch of `--num-prompts` chat prompts decodes `--max-tokens` tokens each, greedily:
unconstrained (EOS ignored, so every sequence runs the full length), under a JSON schema
whose documents cannot close before the limit (an array of at least 1000 strings), and
under a regex over free text (EOS held back until the limit). The token counts are
equal, so the ratio of the runs' times is the ratio of their per-token costs: the
grammar's mask on every sequence at every step, and the sampler's per-row path that a
constrained sequence takes.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

from bench.report import write_json
from engine.llm_engine import LLMEngine
from engine.model_loader import load
from engine.sampling_params import SamplingParams
from engine.structured import json_schema_grammar, regex_grammar
from server.config import AlchemistConfig

LONG_DOCUMENT = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"},
                                                            "minItems": 1000}},
                 "required": ["notes"], "additionalProperties": False}
FREE_TEXT = r"[A-Za-z ,.]+"
QUESTIONS = ["List facts about the Moon.", "Describe a city you like.", "Write notes about rivers.",
             "What is in a kitchen?", "Name some animals.", "Explain how bread is made.",
             "Summarise a football match.", "Plan a trip to the sea."]


def run_structured_bench(config: AlchemistConfig, num_prompts: int = 8, max_tokens: int = 64, repeats: int = 3,
                         json_path: str | None = None) -> dict:
    model, tokenizer, name = load(config.model)
    engine = LLMEngine.for_model(model, tokenizer, config)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
               for i in range(num_prompts)]
    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # min_tokens: a regex that may end anywhere does not end before the others
    runs = {"unconstrained": plain,
            "json_schema": dataclasses.replace(plain, ignore_eos=False, grammar=json_schema_grammar(LONG_DOCUMENT)),
            "regex": dataclasses.replace(plain, ignore_eos=False, min_tokens=max_tokens,
                                         grammar=regex_grammar(FREE_TEXT, "regex"))}
    for params in runs.values():  # warm-up, and the grammar compiler's one-time tokenizer conversion
        engine.generate(prompts[:1], dataclasses.replace(params, max_tokens=2, min_tokens=0))
    seconds: dict[str, list[float]] = {key: [] for key in runs}
    tokens: dict[str, int] = {}
    for round_index in range(repeats):
        for key, params in runs.items():
            started = time.perf_counter()
            outputs = engine.generate(prompts, params)
            seconds[key].append(time.perf_counter() - started)
            tokens[key] = sum(len(choices[0]) for choices in outputs)
            print(f"round {round_index + 1}/{repeats}  {key:<13} {seconds[key][-1]:7.2f} s  "
                  f"{tokens[key]} tokens", flush=True)
    median = {key: statistics.median(values) for key, values in seconds.items()}
    base = median["unconstrained"] / tokens["unconstrained"]
    result = {
        "model": name,
        "num_prompts": num_prompts,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "tokens": tokens,
        "seconds": {key: round(value, 3) for key, value in median.items()},
        "seconds_all_rounds": {key: [round(v, 3) for v in values] for key, values in seconds.items()},
        # per generated token, constrained over unconstrained
        "ratio_per_token": {key: round(median[key] / tokens[key] / base, 3) for key in runs if key != "unconstrained"},
        "added_ms_per_token": {key: round((median[key] / tokens[key] - base) * 1e3, 3)
                               for key in runs if key != "unconstrained"},
    }
    print(json.dumps(result, indent=2))
    write_json(result, json_path)
    return result
