"""`alchemist bench prefix-cache`: requests that share a long beginning (a system prompt,
a document, a conversation so far), served with the prefix cache and without it, side by
side in interleaved rounds on one model.

Each round takes a new shared beginning of `--prefix-tokens` tokens and `--num-requests`
requests, each that beginning and a question of its own (`--suffix-tokens`), served one
after another (a client waiting for each answer: the case the cache is for; requests
admitted in one step compute their shared blocks together, as in vLLM). The first request
of a round finds nothing cached. Reported: the median time to first token of the others
(the cache's gain), of the first (what looking up and naming blocks costs a miss), the
round's seconds, the prompt tokens computed, and whether both paths gave the same tokens.
Then the same requests on another beginning come at once (a burst: admitted in one step,
they share the blocks that step computes for the first): the time to the last of their
first tokens, the burst's seconds, the tokens computed.
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


@dataclasses.dataclass
class RoundResult:
    # seconds from adding each request to its first token, in order
    ttft: list[float]
    seconds: float
    # tokens the engine computed (prompts and decodes)
    computed: int
    tokens: list[list[int]]


def serve_one_by_one(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> RoundResult:
    ttft, tokens, computed = [], [], 0
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
        added, first, answer = time.perf_counter(), None, []
        while engine.has_unfinished():
            outputs, stats = engine.step()
            computed += stats.num_scheduled_tokens
            for out in outputs:
                answer += out.outputs[0].token_ids
                if first is None and answer:
                    first = time.perf_counter()
        ttft.append(first - added)
        tokens.append(answer)
    return RoundResult(ttft, time.perf_counter() - started, computed, tokens)


def serve_together(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> RoundResult:
    """All of `prompts` at once (a burst): admitted in one step, they share its blocks."""
    started, computed, first = time.perf_counter(), 0, {}
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    answers: dict[str, list[int]] = {rid: [] for rid in ids}
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        outputs, stats = engine.step()
        computed += stats.num_scheduled_tokens
        for out in outputs:
            answers[out.request_id] += out.outputs[0].token_ids
            first.setdefault(out.request_id, time.perf_counter() - started)
    return RoundResult([first[rid] for rid in ids], time.perf_counter() - started, computed,
                       [answers[rid] for rid in ids])


def run_prefix_cache_bench(config: AlchemistConfig, prefix_tokens: int = 1000, suffix_tokens: int = 32,
                           num_requests: int = 8, max_tokens: int = 16, repeats: int = 3,
                           json_path: str | None = None) -> dict:
    model, tokenizer, name = load(config.model)
    cache_on = dataclasses.replace(config.cache, enable_prefix_caching=True)
    cache_off = dataclasses.replace(config.cache, enable_prefix_caching=False)
    # the same weights: only the KV cache's bookkeeping differs
    engines = {"cached": LLMEngine.for_model(model, tokenizer, dataclasses.replace(config, cache=cache_on)),
               "plain": LLMEngine.for_model(model, tokenizer, dataclasses.replace(config, cache=cache_off))}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    for key, engine in engines.items():  # warm-up, on a beginning no round uses
        serve_one_by_one(engine, [synthetic_tokens(tokenizer, 64, 999)] * 2, params, f"warm-{key}")
    rounds: dict[str, list[RoundResult]] = {key: [] for key in engines}
    bursts: dict[str, list[RoundResult]] = {key: [] for key in engines}
    for r in range(repeats):
        prefix = synthetic_tokens(tokenizer, prefix_tokens, 2 * r)
        prompts = [prefix + synthetic_tokens(tokenizer, suffix_tokens, 1000 + 7 * r + i) for i in range(num_requests)]
        burst = [synthetic_tokens(tokenizer, prefix_tokens, 2 * r + 1) + prompt[-suffix_tokens:] for prompt in prompts]
        for key, engine in (engines.items() if r % 2 == 0 else reversed(engines.items())):
            rounds[key].append(serve_one_by_one(engine, prompts, params, f"{key}-{r}"))
            result = rounds[key][-1]
            print(f"round {r + 1}/{repeats}  {key:<6} {result.seconds:6.2f} s  first token "
                  f"{result.ttft[0] * 1e3:7.1f} ms, then {statistics.median(result.ttft[1:]) * 1e3:7.1f} ms "
                  f"(median)  {result.computed} tokens computed", flush=True)
            bursts[key].append(serve_together(engine, burst, params, f"{key}-{r}-burst"))
            result = bursts[key][-1]
            print(f"round {r + 1}/{repeats}  {key:<6} burst of {num_requests}: {result.seconds:6.2f} s, first tokens "
                  f"by {max(result.ttft) * 1e3:7.1f} ms  {result.computed} tokens computed", flush=True)

    def median_of(key: str, figure) -> float:
        return statistics.median(figure(result) for result in rounds[key])

    figures = {
        "ttft_shared_ms": lambda res: statistics.median(res.ttft[1:]) * 1e3,
        "ttft_first_ms": lambda res: res.ttft[0] * 1e3,
        "round_seconds": lambda res: res.seconds,
        "computed_tokens": lambda res: res.computed,
    }
    medians = {key: {name_: round(median_of(key, f), 2) for name_, f in figures.items()} for key in engines}
    for key in engines:  # the bursts: every request's first token, the burst's seconds, the tokens computed
        medians[key].update(
            burst_last_first_token_ms=round(statistics.median(max(b.ttft) for b in bursts[key]) * 1e3, 1),
            burst_seconds=round(statistics.median(b.seconds for b in bursts[key]), 2),
            burst_computed_tokens=statistics.median(b.computed for b in bursts[key]))
    result = {
        "model": name,
        "prefix_tokens": len(prompts[0]) - suffix_tokens, "suffix_tokens": suffix_tokens,
        "num_requests": num_requests, "max_tokens": max_tokens, "repeats": repeats,
        "medians": medians,
        "ttft_shared_plain_over_cached": round(medians["plain"]["ttft_shared_ms"]
                                               / medians["cached"]["ttft_shared_ms"], 2),
        "ttft_first_cached_over_plain": round(medians["cached"]["ttft_first_ms"]
                                              / medians["plain"]["ttft_first_ms"], 3),
        "round_plain_over_cached": round(medians["plain"]["round_seconds"] / medians["cached"]["round_seconds"], 2),
        "burst_plain_over_cached": round(medians["plain"]["burst_seconds"] / medians["cached"]["burst_seconds"], 2),
        "same_tokens": all(a.tokens == b.tokens for a, b in zip(rounds["cached"] + bursts["cached"],
                                                              rounds["plain"] + bursts["plain"])),
    }
    print(json.dumps(result, indent=2))
    write_json(result, json_path)
    return result
