"""`alchemist bench serving`: the engine against Hugging Face, side by side in one run.

N distinct chat prompts, greedy, exactly `max_tokens` new tokens each (EOS suppressed
until then: `min_tokens` here, `min_new_tokens` in `generate`), run through
  - the engine, all N at once (continuous batching),
  - the engine, one request at a time (what batching buys),
  - the engine with plain `F.linear` instead of oneDNN-packed weights (what packing buys;
    on the CPU), with `enforce_eager` (what CUDA graphs buy; on a GPU), and with
    `decode_attention = "flex"` (decode rows reading the KV pool in place instead of
    gathered, engine/paged_decode.py; its own CUDA graphs, one per batch bucket),
  - `model.generate` on a static batch with left padding,
  - `model.generate_batch`, transformers' own continuous batching (it stops at EOS, so
    its tokens are counted, not assumed),
With `with_adapter`, three more engines serve with a (zero-initialised) LoRA adapter
attached as in training mode — through merged weights (training mode's default on CPU),
through the lean unmerged path, and through PEFT's own forward — to show what training
mode costs serving and what each path saves.
All paths run in interleaved rounds, after a warm-up, each round on new prompts of a new
length (unless `same_prompts`): the first round is reported apart as cold (shapes never
seen, as under real traffic), the median of the others as warm, with their ratios; the
engine's greedy tokens are checked against `generate`'s token for token. The Hugging
Face paths run on their own, untouched copies of the model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from typing import Callable

import torch

from server.config import AlchemistConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import load
from engine.sampling_params import SamplingParams
from bench.report import write_json, write_profile
from bench.traces import chat_prompts

logger = logging.getLogger(__name__)

def hf_static_generate(model, tokenizer, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(model.device)
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return [row.tolist() for row in out[:, batch["input_ids"].shape[1]:]]


def hf_generate_batch(model, tokenizer, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():  # generate_batch writes its own buffers in place: not under inference_mode
        out = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    return [list(out[key].generated_tokens) for key in sorted(out, key=lambda k: int(k.split("_")[-1]))]


def _timed(fn: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def _adapter_engine(config: AlchemistConfig, tokenizer, variant: str) -> LLMEngine:
    """variant: merged | lean | peft"""
    from trainer.config import TrainConfig
    from peft.tuners.lora.layer import Linear as LoraLinear
    from server.build import build_training_engine

    model, _, _ = load(config.model)
    engine, trainer = build_training_engine(model, tokenizer, config,
                                            TrainConfig(mode="cpt", merged_serving=variant == "merged"))
    if variant == "peft":
        for module in trainer.peft_model.modules():
            if isinstance(module, LoraLinear):
                module.__class__ = LoraLinear
    return engine


def round_prompts(tokenizer, count: int, round_index: int, same_prompts: bool = False) -> list[list[int]]:
    """The prompts of one round (round -1: the warm-up). Each round's are new questions,
    one filler word longer than the round before's, so that no round repeats another's
    shapes — a server under real traffic rarely does — unless `same_prompts`."""
    if same_prompts:
        return chat_prompts(tokenizer, count)
    return chat_prompts(tokenizer, count, offset=(round_index + 1) * count, extra_words=round_index + 1)


def _interleaved_rounds(paths: dict[str, Callable[[list[list[int]]], list[list[int]]]],
                        prompts: Callable[[int], list[list[int]]], repeats: int):
    """Runs every path once per round on that round's prompts, `repeats` rounds; (tokens/s
    per path and round, each path's tokens of the last round)."""
    rates: dict[str, list[float]] = {key: [] for key in paths}
    outputs: dict[str, list[list[int]]] = {}
    for round_index in range(repeats):
        this_round = prompts(round_index)
        for key, fn in paths.items():
            seconds, tokens = _timed(lambda: fn(this_round))
            outputs[key] = tokens
            rates[key].append(sum(len(t) for t in tokens) / seconds)
            kind = "cold" if round_index == 0 else "warm"
            print(f"round {round_index + 1}/{repeats} ({kind})  {key:<20} {rates[key][-1]:8.1f} tokens/s", flush=True)
    return rates, outputs


def cold_and_warm(rates: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Per path: the first round's tokens/s (cold: shapes never seen) and the median of
    the others' (warm; the first round's when there is only one)."""
    cold = {key: values[0] for key, values in rates.items()}
    warm = {key: statistics.median(values[1:] or values) for key, values in rates.items()}
    return cold, warm


PATHS = ("engine", "engine_sequential", "engine_plain_linear", "engine_eager", "engine_flex", "hf_generate",
         "hf_generate_batch")
RATIOS = {"ratio_engine_over_hf_generate": ("engine", "hf_generate"),
          "ratio_graphs_over_eager": ("engine", "engine_eager"),
          "ratio_flex_over_engine": ("engine_flex", "engine"),
          "ratio_engine_over_hf_generate_batch": ("engine", "hf_generate_batch"),
          "ratio_concurrent_over_sequential": ("engine", "engine_sequential"),
          "ratio_packed_over_plain_linear": ("engine", "engine_plain_linear")}


def _figures(rates: dict[str, list[float]], outputs: dict[str, list[list[int]]], with_adapter: bool) -> dict:
    """Tokens/s cold and warm per path, their ratios, and which paths' tokens agree."""
    cold, median = cold_and_warm(rates)
    figures = {
        "tokens_per_s": {key: round(value, 2) for key, value in median.items()},
        "cold_tokens_per_s": {key: round(value, 2) for key, value in cold.items()},
        "tokens_per_s_all_rounds": {key: [round(v, 2) for v in values] for key, values in rates.items()},
        "engine_cold_time_over_warm": round(median["engine"] / cold["engine"], 3),
        **{key: round(median[a] / median[b], 3) for key, (a, b) in RATIOS.items() if a in median and b in median},
        **{f"cold_{key}": round(cold[a] / cold[b], 3) for key, (a, b) in RATIOS.items() if a in cold and b in cold},
    }
    if with_adapter:
        variants = ("merged", "lean", "peft")
        figures.update({f"ratio_adapter_{v}_over_engine": round(median[f"engine_adapter_{v}"] / median["engine"], 3)
                        for v in variants})
        figures["adapter_equal_to_engine"] = all(outputs[f"engine_adapter_{v}"] == outputs["engine"]
                                                 for v in variants)
    for key, other in (("greedy_equal_to_generate", "hf_generate"), ("batched_equal_to_alone", "engine_sequential"),
                       ("packed_equal_to_plain_linear", "engine_plain_linear"),
                       ("graphs_equal_to_eager", "engine_eager"), ("flex_equal_to_engine", "engine_flex")):
        if other in outputs:
            mismatched = [i for i, (a, b) in enumerate(zip(outputs["engine"], outputs[other])) if a != b]
            figures[key] = not mismatched
            if other == "hf_generate":
                figures["greedy_mismatched_prompts"] = mismatched
            if other == "engine_flex":  # bfloat16 attention summed in another order may flip a near-tie
                figures["flex_mismatched_prompts"] = mismatched
    return figures


def run_serving_bench(config: AlchemistConfig, num_prompts: int = 8, max_tokens: int = 64, repeats: int = 3,
                      json_path: str | None = None, with_adapter: bool = False,
                      paths: tuple[str, ...] = PATHS, profile_path: str | None = None,
                      same_prompts: bool = False) -> dict:
    """`paths` selects among PATHS ("engine" always runs). On a GPU the engine leaves the
    model untouched (packing is a CPU path), so `generate` shares it and the plain-linear
    engine, identical there, is skipped; `generate_batch` keeps its own copy."""
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    model, tokenizer, name = load(config.model)
    on_cpu = next(model.parameters()).device.type == "cpu"
    # on a GPU the engine leaves the model unpacked, and on the CPU there are no CUDA graphs
    selected = {"engine", *paths} - ({"engine_eager"} if on_cpu else {"engine_plain_linear"})
    hf_model = load(config.model)[0] if on_cpu and "hf_generate" in selected else model
    cb_model = load(config.model)[0] if "hf_generate_batch" in selected else None
    engine = LLMEngine.for_model(model, tokenizer, config)
    plain_engine = None
    if "engine_plain_linear" in selected:
        plain_config = dataclasses.replace(config, model=dataclasses.replace(config.model, packed_linear=False))
        plain_engine = LLMEngine.for_model(load(config.model)[0], tokenizer, plain_config)
    eager_engine = None
    if "engine_eager" in selected:  # the same model, its decode step never replayed from CUDA graphs
        eager_config = dataclasses.replace(config, model=dataclasses.replace(config.model, enforce_eager=True))
        eager_engine = LLMEngine.for_model(model, tokenizer, eager_config)
    flex_engine = None
    if "engine_flex" in selected:  # the same model, decode attention reading the pool in place
        flex_config = dataclasses.replace(config, model=dataclasses.replace(config.model, decode_attention="flex"))
        flex_engine = LLMEngine.for_model(model, tokenizer, flex_config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    warm = SamplingParams(temperature=0.0, max_tokens=2)

    extra_engines = {}
    if with_adapter:
        extra_engines = {f"engine_adapter_{variant}": _adapter_engine(config, tokenizer, variant)
                         for variant in ("merged", "lean", "peft")}
    candidates = {
        "engine": lambda prompts: [choices[0] for choices in engine.generate(prompts, params)],
        "engine_sequential": lambda prompts: [engine.generate([p], params)[0][0] for p in prompts],
        "engine_plain_linear": lambda prompts: [choices[0] for choices in plain_engine.generate(prompts, params)],
        "engine_eager": lambda prompts: [choices[0] for choices in eager_engine.generate(prompts, params)],
        "engine_flex": lambda prompts: [choices[0] for choices in flex_engine.generate(prompts, params)],
        "hf_generate": lambda prompts: hf_static_generate(hf_model, tokenizer, prompts, max_tokens),
        "hf_generate_batch": lambda prompts: hf_generate_batch(cb_model, tokenizer, prompts, max_tokens),
    }
    timed = {**{key: (lambda prompts, e=e: [c[0] for c in e.generate(prompts, params)])
                for key, e in extra_engines.items()},
             **{key: fn for key, fn in candidates.items() if key in selected}}
    logger.info("warming up each path")
    warmup_prompts = round_prompts(tokenizer, 2, -1, same_prompts)
    for extra in [engine, plain_engine, eager_engine, flex_engine, *extra_engines.values()]:
        if extra is not None:
            extra.generate(warmup_prompts, warm)
    if "hf_generate" in selected:
        hf_static_generate(hf_model, tokenizer, warmup_prompts, 2)
    if cb_model is not None:
        hf_generate_batch(cb_model, tokenizer, warmup_prompts, 2)

    rates, outputs = _interleaved_rounds(
        timed, lambda round_index: round_prompts(tokenizer, num_prompts, round_index, same_prompts), repeats)
    if profile_path:
        prompts = round_prompts(tokenizer, num_prompts, repeats, same_prompts)
        write_profile(profile_path, {"engine": lambda: engine.generate(prompts, params)})
    result = {"model": name, "dtype": str(next(model.parameters()).dtype),
              "device": str(next(model.parameters()).device), "num_prompts": num_prompts, "max_tokens": max_tokens,
              "repeats": repeats, "torch_threads": torch.get_num_threads(), "same_prompts": same_prompts,
              **_figures(rates, outputs, with_adapter), "kv_cache_bytes_per_token": engine.kv_spec.bytes_per_token}
    for key, captured in (("cuda_graphs", engine), ("cuda_graphs_flex", flex_engine)):
        capture = captured.graph_capture if captured is not None else None
        if capture is not None:
            result[key] = {"graphs": capture.graphs, "capture_s": round(capture.seconds, 2),
                           "memory_mib": round(capture.memory_bytes / 2**20, 1)}
    print(json.dumps(result, indent=2))
    write_json(result, json_path)
    return result
