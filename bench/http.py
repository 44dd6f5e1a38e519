"""`alchemist bench http`: what serving over HTTP costs a streamed token, against the
engine alone, side by side in one run.

At each concurrency (`--streams`, e.g. 1, 8, 32), N chat requests of exactly `max_tokens`
greedy tokens each, all sent at once (a closed batch), run two ways in alternating rounds:
  - `engine`: the engine in this process, stepped until every request is done;
  - `http`: streamed from `alchemist serve` in a subprocess (the same model, cache and
    scheduler settings, training off) by an asyncio client, tokens counted from the usage
    each chunk carries (`stream_options.continuous_usage_stats`).
Each round asks new questions, one filler word longer than the round before's; the first
round is reported apart as cold. Per path: the mean time per output token (a request's
first token to its last, over the tokens between) and tokens per second. For HTTP also:
the server's own mean TPOT (its histogram), and the CPU seconds per output token of its
event loop's thread (HTTP, JSON, SSE) and of its device thread. For both paths: the engine
steps the round ran by kind (decode, prefill, mixed) and their mean seconds. Requests that
reach the server one after another take prefill or mixed steps between the decodes of
those already running, where the engine path admits every request before its first step.
The figure the issue sets (issue 23): HTTP's TPOT within 1.1x of the engine's. The client runs on this machine too:
on a two-core CPU its parsing competes with the server's threads.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import statistics
import time

import httpx

from bench.launch import running_server
from bench.report import read_metric, steps_by_kind, write_json
from bench.traces import chat_questions
from engine.llm_engine import LLMEngine
from engine.model_loader import load
from engine.sampling_params import SamplingParams
from server.config import AlchemistConfig

ENGINE_SECTIONS = ("model", "cache", "scheduler")


def server_environment(config: AlchemistConfig) -> dict[str, str]:
    """The engine's sections of `config` as `ALCHEMIST_*` variables, for the server subprocess."""
    env = {}
    for section in ENGINE_SECTIONS:
        for name, value in dataclasses.asdict(getattr(config, section)).items():
            if isinstance(value, bool):
                value = "true" if value else "false"
            elif isinstance(value, (tuple, list)):
                value = ",".join(str(v) for v in value)
            env[f"ALCHEMIST_{section.upper()}_{name.upper()}"] = str(value)
    return env


def round_questions(streams: int, round_index: int) -> list[str]:
    return chat_questions(streams, offset=(round_index + 1) * streams, extra_words=round_index + 1)


def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else math.nan


def _tpot(first: float, last: float, tokens: int) -> float | None:
    return (last - first) / (tokens - 1) if tokens > 1 else None


# the steps a round ran, by kind: an admission that arrives while others decode costs them a prefill or mixed step
ROUND_STEP_KINDS = ("decode", "prefill", "mixed")


def _step_figures(counts: dict[str, float], seconds: dict[str, float]) -> dict[str, float]:
    """Per kind: the steps a round ran and their mean seconds (NaN: none ran)."""
    figures = {}
    for kind in ROUND_STEP_KINDS:
        figures[f"{kind}_steps"] = counts.get(kind, 0)
        figures[f"{kind}_step_mean_s"] = seconds.get(kind, 0.0) / counts[kind] if counts.get(kind) else math.nan
    return figures


def engine_round(engine: LLMEngine, tokenizer, questions: list[str], max_tokens: int) -> dict:
    """The questions through the engine at once; mean TPOT and tokens per second."""
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    first, last, counts = {}, {}, {}
    steps, step_seconds = collections.Counter(), collections.Counter()
    started = time.perf_counter()  # the HTTP path's time includes rendering and admission too
    for i, question in enumerate(questions):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        engine.add(engine.make_request(f"r{i}", list(ids), params, time.monotonic()))
    while engine.has_unfinished():
        outputs, stats = engine.step()
        now = time.perf_counter()
        steps[stats.kind] += 1
        step_seconds[stats.kind] += stats.seconds
        for output in outputs:
            new = sum(len(c.token_ids) for c in output.outputs)
            if new:
                first.setdefault(output.request_id, now)
                last[output.request_id] = now
                counts[output.request_id] = counts.get(output.request_id, 0) + new
    elapsed = time.perf_counter() - started
    tpots = [t for r in counts if (t := _tpot(first[r], last[r], counts[r])) is not None]
    return {"tpot_mean_s": _mean(tpots), "tokens_per_s": sum(counts.values()) / elapsed,
            "tokens": sum(counts.values()), **_step_figures(steps, step_seconds)}


async def _stream_one(client: httpx.AsyncClient, model: str, question: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "stream": True,
            "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0.0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    first = last = None
    tokens = first_count = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            count = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", 0)
            if count > tokens:
                last = time.perf_counter()
                if first is None:
                    first, first_count = last, count
                tokens = count
    return {"tokens": tokens, "tpot": (last - first) / (tokens - first_count) if tokens > first_count else None}


async def _http_round(url: str, questions: list[str], max_tokens: int) -> tuple[list[dict], float, tuple]:
    limits = httpx.Limits(max_connections=len(questions) + 4, max_keepalive_connections=len(questions) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        # two scrapes before: the CPU between them is one scrape's, taken out of the round's
        first = (await client.get("/metrics")).text
        before = (await client.get("/metrics")).text
        started = time.perf_counter()
        results = await asyncio.gather(*[_stream_one(client, model, q, max_tokens) for q in questions])
        elapsed = time.perf_counter() - started
        after = (await client.get("/metrics")).text
    return results, elapsed, (first, before, after)


def http_round(url: str, questions: list[str], max_tokens: int) -> dict:
    """The questions streamed over HTTP at once; client and server TPOT, threads' CPU per token."""
    results, elapsed, (first, before, after) = asyncio.run(_http_round(url, questions, max_tokens))
    delta = lambda name: read_metric(after, name) - read_metric(before, name)  # noqa: E731

    def cpu_seconds(thread: str) -> float:  # less one scrape's own cost
        name = f'alchemist:thread_cpu_seconds_total{{thread="{thread}"}}'
        return max(0.0, delta(name) - (read_metric(before, name) - read_metric(first, name)))

    tokens = sum(r["tokens"] for r in results)
    tpots = [r["tpot"] for r in results if r["tpot"] is not None]
    steps = steps_by_kind(before, after)
    step_counts = {kind: steps[kind]["steps"] for kind in ROUND_STEP_KINDS}
    histogram = "alchemist:request_time_per_output_token_seconds"
    return {"tpot_mean_s": _mean(tpots), "tokens_per_s": tokens / elapsed, "tokens": tokens,
            "server_tpot_mean_s": delta(f"{histogram}_sum") / max(delta(f"{histogram}_count"), 1),
            # the device's wait between serving steps (the event loop's round trip), per step
            "step_gap_ms": 1000 * delta("alchemist:engine_step_gap_seconds_total")
            / max(delta("alchemist:engine_serving_steps_total"), 1),
            **{f"{thread}_cpu_ms_per_token": 1000 * cpu_seconds(thread) / max(tokens, 1)
               for thread in ("event_loop", "device")},
            **_step_figures(step_counts, {kind: steps[kind]["seconds"] for kind in ROUND_STEP_KINDS})}


def _steps_line(result: dict) -> str:
    return ", ".join(f"{int(result[f'{kind}_steps'])} {kind} ({1000 * result[f'{kind}_step_mean_s']:.1f} ms)"
                     for kind in ROUND_STEP_KINDS if result[f"{kind}_steps"])


def _summary(rounds: list[dict]) -> dict:
    """The first round (cold) and the median of the others (warm), key by key; a figure a
    round has none of (NaN: no step of that kind) is left out of its median."""
    warm = rounds[1:] or rounds

    def median(key: str) -> float:
        values = [r[key] for r in warm if not math.isnan(r[key])]
        return statistics.median(values) if values else math.nan

    return {"cold": rounds[0], "warm": {key: median(key) for key in rounds[0]}}


def run_http_bench(config: AlchemistConfig, streams: list[int], max_tokens: int = 64, rounds: int = 3,
                   json_path: str | None = None, async_output: str = "auto") -> dict:
    """`async_output`: the server's `server.async_output` (auto, on, off)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    model, tokenizer, _ = load(config.model)
    engine = LLMEngine.for_model(model, tokenizer, config)
    report = {"max_tokens": max_tokens, "rounds": rounds, "async_output": async_output, "streams": {}}
    env = {**server_environment(config), "ALCHEMIST_SERVER_ASYNC_OUTPUT": async_output}
    with running_server("--train-mode", "off", env=env) as url:
        engine_round(engine, tokenizer, round_questions(2, -1), 4)  # warm-ups, not reported
        http_round(url, round_questions(2, -1), 4)
        for n in streams:
            paths = {"engine": [], "http": []}
            for round_index in range(rounds):
                questions = round_questions(n, round_index)
                order = ("engine", "http") if round_index % 2 == 0 else ("http", "engine")
                for path in order:
                    result = engine_round(engine, tokenizer, questions, max_tokens) if path == "engine" \
                        else http_round(url, questions, max_tokens)
                    paths[path].append(result)
                    extra = (f"  server TPOT {1000 * result['server_tpot_mean_s']:.1f} ms  event loop "
                             f"{result['event_loop_cpu_ms_per_token']:.3f} ms CPU/token  gap between steps "
                             f"{result['step_gap_ms']:.2f} ms") if path == "http" else ""
                    print(f"{n:3d} streams  round {round_index + 1}/{rounds}  {path:<6} TPOT "
                          f"{1000 * result['tpot_mean_s']:7.1f} ms  {result['tokens_per_s']:7.1f} tokens/s{extra}"
                          f"  steps {_steps_line(result)}", flush=True)
            figures = {path: _summary(values) for path, values in paths.items()}
            warm = {path: figures[path]["warm"] for path in paths}
            figures["ratio_http_over_engine_tpot"] = warm["http"]["tpot_mean_s"] / warm["engine"]["tpot_mean_s"]
            figures["ratio_engine_over_http_tokens_per_s"] = (warm["engine"]["tokens_per_s"]
                                                              / warm["http"]["tokens_per_s"])
            figures["rounds"] = paths
            report["streams"][str(n)] = figures
            print(f"{n:3d} streams  warm: HTTP TPOT over the engine's {figures['ratio_http_over_engine_tpot']:.3f}x; "
                  f"event loop {warm['http']['event_loop_cpu_ms_per_token']:.3f} ms CPU per token", flush=True)
    write_json(report, json_path)
    return report
