"""`alchemist bench colocate`: serving latency with and without training, over real HTTP.

A seeded Poisson arrival trace with prompt and output lengths drawn from a ShareGPT-like
distribution (synthetic: log-normal lengths fitted by eye to ShareGPT's shape, scaled to
this CPU; the text is a fixed English passage) is streamed against a server the bench
starts: once with training off and once on (DPO, the client sending feedback on every
response), alternating, in rounds. Each server first runs a warm-up trace of other
requests, reported apart as cold (its first traffic, every shape new). Client-side: mean
and p99 time per output token, p50 and p99 time to first token, tokens counted from the
usage each chunk carries (`continuous_usage_stats`), not from text chunks; server-side:
its own TTFT/TPOT/ITL histograms beside them, training tokens per second harvested and
the longest training slice. `--sweep` runs several rates and plots TPOT against rate, on and
off (cf. the paper's Figure 10, right).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

import httpx

from bench.launch import running_server
from bench.report import (TRAINING_PATHS, percentile, pyplot, read_metric, reuse_share, steps_by_kind, trained_by_path,
                          write_json)
from bench.traces import WORDS, TraceRequest, make_trace
from engine.scheduler import STEP_KINDS
from trainer.config import TrainConfig
from trainer.status import SLICE_BUCKETS


async def _one(client: httpx.AsyncClient, model: str, request: TraceRequest, start: float, feedback: bool,
               rng: random.Random) -> dict:
    """One streamed request. Tokens are counted from the usage every chunk carries
    (`stream_options.continuous_usage_stats`), not from text chunks: a token that decodes
    to no text sends no chunk of its own, and is counted in the next one."""
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    sent = time.perf_counter()
    arrivals: list[tuple[float, int]] = []  # (time, completion tokens so far) when the count grew
    completion_id = None
    body = {"model": model, "messages": [{"role": "user", "content": request.prompt}], "stream": True,
            "max_tokens": request.output_tokens, "min_tokens": request.output_tokens,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            completion_id = chunk["id"]
            tokens = (chunk.get("usage") or {}).get("completion_tokens", 0)
            if tokens > (arrivals[-1][1] if arrivals else 0):
                arrivals.append((time.perf_counter(), tokens))
    if feedback and completion_id:
        chosen = " ".join(rng.choice(WORDS) for _ in range(max(4, request.output_tokens // 2)))
        await client.post("/v1/feedback", json={"id": completion_id, "chosen": chosen})
    ttft = arrivals[0][0] - sent if arrivals else math.nan
    tpot = math.nan
    if len(arrivals) > 1:
        (first_time, first_tokens), (last_time, last_tokens) = arrivals[0], arrivals[-1]
        tpot = (last_time - first_time) / (last_tokens - first_tokens)
    return {"ttft": ttft, "tpot": tpot, "tokens": arrivals[-1][1] if arrivals else 0}


async def run_trace(url: str, trace: list[TraceRequest], feedback: bool, seed: int,
                    feedback_fraction: float = 1.0) -> list[dict]:
    """Sends `trace` to the server at `url`, each request at its arrival time, with
    feedback (a share of the answers, drawn by `seed`); each request's TTFT, TPOT, tokens."""
    rng = random.Random(seed + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        start = time.perf_counter()
        # which answers get feedback is drawn up front, so every run labels the same requests
        labelled = [feedback and rng.random() < feedback_fraction for _ in trace]
        return await asyncio.gather(*[_one(client, model, r, start, label, rng) for r, label in zip(trace, labelled)])


@dataclass(frozen=True)
class TrainingSide:
    """How the training-on server runs: arbiter policy, extra TOML, and whether the
    client sends feedback (without it, DPO entries are recorded but never trained)."""

    policy: str = "idle"
    tpot_slo_ms: float = 100.0
    config_file: str | None = None
    feedback: bool = True
    # the share of answers that get feedback (the rest never do: their entries wait out the label timeout)
    feedback_fraction: float = 1.0
    # what the two conditions differ in: "training" (off, on), "ledger" (training on, with
    # an adapter directory, without and with the feedback ledger), "gate" (training on,
    # without and with the eval gate on `eval_set`) or "ride" (training on, a recorded
    # prefill's step alone, then with running decodes riding along in its forward: the default)
    # or "trim" (training on, every pause in recording giving freed memory back, then only
    # beyond `train.trim_slack_mib`: the default)
    compare: str = "training"
    eval_set: str = "examples/capital_probes.jsonl"

    def condition(self, variant: bool) -> tuple[bool, dict[str, str]]:
        """(training on, extra environment) of the baseline (False) or the variant (True)."""
        if self.compare == "ledger":
            return True, {"ALCHEMIST_LEDGER_ENABLED": "true" if variant else "false"}
        if self.compare == "gate":
            return True, {"ALCHEMIST_TRAIN_EVAL_SET": self.eval_set if variant else ""}
        if self.compare == "ride":
            return True, {"ALCHEMIST_SCHEDULER_RECORDED_PREFILL_ALONE": "false" if variant else "true"}
        if self.compare == "trim":
            return True, {"ALCHEMIST_TRAIN_TRIM_SLACK_MIB": str(TrainConfig.trim_slack_mib) if variant else "0"}
        return variant, {}


def _caught_up(url: str, timeout_s: float = 120.0) -> str:
    """The server's metrics once its trainer has caught up (no entry ready or training)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics").text
        if all(read_metric(text, f'alchemist:activation_cache_entries{{state="{s}"}}') == 0
               for s in ("ready", "training")):
            return text
        time.sleep(1.0)
    print(f"  the trainer did not catch up in {timeout_s:.0f} s: what it trains next is counted as if it had",
          flush=True)
    return text


def _trained_after_catching_up(url: str, before: str) -> dict:
    """Once the trainer has caught up, the entries trained since `before` by path, the
    share that trained on the served activations (reuse or stashed reuse), and the
    staleness distribution (versions between serving and training)."""
    text = _caught_up(url)
    paths = trained_by_path(text, "dpo", before)
    staleness = {}
    for bound in ("0", "1", "2", "4", "8", "16", "+Inf"):
        name = f'alchemist:trained_entry_staleness_bucket{{le="{bound}"}}'
        staleness[bound] = read_metric(text, name) - read_metric(before, name)
    dropped = read_metric(text, 'alchemist:activation_cache_ended_entries_total{state="dropped"}') - read_metric(
        before, 'alchemist:activation_cache_ended_entries_total{state="dropped"}')
    caught_up = {f"{name}_by_the_end": read_metric(text, metric) - read_metric(before, metric)
                 for name, metric in (("train_tokens", "alchemist:train_tokens_total"),
                                      ("optimizer_steps", "alchemist:adapter_version"))}
    return {"trained_by_path": paths, "dropped_entries": dropped, **caught_up,
            "reuse_share": reuse_share(paths),
            "staleness_le": staleness}


def _longest_slice(before: str, after: str) -> tuple[float, str]:
    """The longest training slice between two scrapes, and what it ran: the server's longest
    so far where it grew meanwhile, else the bound of the highest slice bucket that grew
    (an upper bound; what it ran is not known then: "")."""
    from prometheus_client.parser import text_string_to_metric_families

    gauge, histogram = "alchemist:train_slice_max_seconds", "alchemist:train_slice_seconds_bucket"
    if read_metric(after, gauge) > read_metric(before, gauge):
        return read_metric(after, gauge), next((sample.labels.get("item", "") for family in
                                                text_string_to_metric_families(after)
                                                for sample in family.samples if sample.name == gauge), "")
    grown = {bound: read_metric(after, f'{histogram}{{le="{bound}"}}')
             - read_metric(before, f'{histogram}{{le="{bound}"}}') for bound in (*map(str, SLICE_BUCKETS[:-1]), "+Inf")}
    least = next(bound for bound, count in grown.items() if count >= grown["+Inf"])  # the least bound holding all
    return (float(least.replace("+Inf", "inf")) if grown["+Inf"] else 0.0), ""




def _mean_delta(before: str, after: str, histogram: str) -> float:
    """The mean of a histogram's observations between two scrapes."""
    count = read_metric(after, f"{histogram}_count") - read_metric(before, f"{histogram}_count")
    total = read_metric(after, f"{histogram}_sum") - read_metric(before, f"{histogram}_sum")
    return total / count if count else math.nan


def _latency(results: list[dict]) -> dict:
    """Client-side TPOT (mean, p99) and TTFT (p50, p99) of a trace's requests, and its tokens."""
    tpots = [r["tpot"] for r in results if not math.isnan(r["tpot"])]
    ttfts = [r["ttft"] for r in results if not math.isnan(r["ttft"])]
    return {"tpot_mean_s": statistics.mean(tpots) if tpots else math.nan, "tpot_p99_s": percentile(tpots, 0.99),
            "ttft_p50_s": percentile(ttfts, 0.50), "ttft_p99_s": percentile(ttfts, 0.99),
            "tokens": sum(r["tokens"] for r in results)}


def run_condition(variant: bool, side: TrainingSide, trace: list[TraceRequest], seed: int, seconds: float,
                  warmup: list[TraceRequest] | None = None) -> dict:
    """One server, one condition: the `warmup` trace first (its figures reported as cold:
    the server's first traffic, every shape new), then `trace` (warm), both with the
    condition's feedback."""
    training, env = side.condition(variant)
    flags = ["--train-mode", "dpo", "--arbiter-policy", side.policy, "--tpot-slo-ms", str(side.tpot_slo_ms)] \
        if training else ["--train-mode", "off"]
    if training and side.config_file:
        flags += ["--config", side.config_file]
    adapter_dir = tempfile.TemporaryDirectory(prefix="alchemist-colocate-") if side.compare == "ledger" else None
    if adapter_dir is not None:
        flags += ["--adapter-dir", adapter_dir.name]
    with running_server(*flags, env=env) as url:
        cold = asyncio.run(run_trace(url, warmup, training and side.feedback, seed + 1, side.feedback_fraction)) \
            if warmup else []
        # the warm-up's labelled entries train before the measured trace, not in it
        before = _caught_up(url) if training and warmup else httpx.get(f"{url}/metrics").text
        started = time.perf_counter()
        results = asyncio.run(run_trace(url, trace, training and side.feedback, seed, side.feedback_fraction))
        elapsed = time.perf_counter() - started
        after = httpx.get(f"{url}/metrics").text
        trained = _trained_after_catching_up(url, before) if training else {}
    if adapter_dir is not None:
        adapter_dir.cleanup()
    train_tokens = read_metric(after, "alchemist:train_tokens_total") - read_metric(before,
                                                                                 "alchemist:train_tokens_total")
    latency = _latency(results)
    # host CPU per output token of the event loop (HTTP, streaming) and the device thread
    cpu_per_token_ms = {f"{thread}_cpu_per_token_ms": 1000 * (
        read_metric(after, f'alchemist:thread_cpu_seconds_total{{thread="{thread}"}}')
        - read_metric(before, f'alchemist:thread_cpu_seconds_total{{thread="{thread}"}}')) / max(latency["tokens"], 1)
        for thread in ("event_loop", "device")}
    return {
        "training": training, "variant": variant, "requests": len(results), "elapsed_s": round(elapsed, 2),
        **latency, **{f"cold_{key}": value for key, value in _latency(cold).items() if cold}, **cpu_per_token_ms,
        "train_tokens_per_s": train_tokens / max(elapsed, seconds),
        **trained,
        # server-side means, from the histograms: arrival to first token, arrival to first
        # scheduled step, that step to the first token (the prefill); the client's TTFT
        # adds the HTTP and event-loop time on top
        **{f"server_{key}_mean_s": _mean_delta(before, after, f"alchemist:{metric}_seconds")
           for key, metric in (("ttft", "time_to_first_token"), ("queue", "request_queue_time"),
                               ("prefill", "request_prefill_time"), ("tpot", "request_time_per_output_token"),
                               ("itl", "inter_token_latency"))},
        # engine steps by kind: a recorded prefill's seconds per token against a plain one's
        "steps": steps_by_kind(before, after),
        **dict(zip(("train_slice_max_s", "train_slice_max_item"), _longest_slice(before, after))),
        "between_step_slices": read_metric(after, 'alchemist:arbiter_slices_total{gap="between_steps",policy="'
                                           + side.policy + '"}') - read_metric(before, 'alchemist:arbiter_slices_total'
                                           '{gap="between_steps",policy="' + side.policy + '"}'),
        **{name: read_metric(after, f"alchemist:{name}_total") - read_metric(before, f"alchemist:{name}_total")
           for name in ("offloaded_layers", "dropped_layers", "reloaded_layers", "recomputed_layers",
                        "unrecorded_prefills", "train_preemptions")},
        # what the device did for training during the trace: seconds in training items, the
        # arbiter's items in idle gaps and its merged-weight rebuilds between serving steps,
        # optimizer steps (the serving version's change: with an eval gate, promotions)
        "train_busy_s": read_metric(after, "alchemist:train_busy_seconds_total")
        - read_metric(before, "alchemist:train_busy_seconds_total"),
        **{f"{gap}_items": read_metric(after, f'alchemist:arbiter_slices_total{{gap="{gap}"}}')
           - read_metric(before, f'alchemist:arbiter_slices_total{{gap="{gap}"}}')
           for gap in ("idle", "merge_between_steps", "warm_between_steps")},
        "optimizer_steps": read_metric(after, "alchemist:adapter_version")
        - read_metric(before, "alchemist:adapter_version"),
    }


RECORDED_AND_PLAIN = (("recorded_prefill", "prefill"), ("recorded_mixed", "mixed"))


def recorded_over_plain(runs: dict[bool, list[dict]]) -> dict:
    """A recorded prefill's seconds per token over a plain one's of the same composition
    (the medians of the rounds, training on over off): alone over a prefill step, with
    decodes riding along over a mixed step; and the training rounds' recorded steps in all
    over what plain steps of their kinds and tokens take (NaN: a kind never ran)."""
    def per_token(variant: bool, kind: str) -> float:
        values = [r["steps"][kind]["s_per_token"] for r in runs[variant]
                  if not math.isnan(r["steps"][kind]["s_per_token"])]
        return statistics.median(values) if values else math.nan

    ratios, recorded_s, plain_s = {}, 0.0, 0.0
    for recorded, plain in RECORDED_AND_PLAIN:
        plain_per_token = per_token(False, plain)
        ratios[recorded] = per_token(True, recorded) / plain_per_token
        tokens = sum(r["steps"][recorded]["tokens"] for r in runs[True])
        if tokens:
            recorded_s += sum(r["steps"][recorded]["seconds"] for r in runs[True])
            plain_s += tokens * plain_per_token
    return {"recorded_alone_per_token_ratio": round(ratios["recorded_prefill"], 4),
            "recorded_mixed_per_token_ratio": round(ratios["recorded_mixed"], 4),
            "recorded_over_plain_of_its_composition": round(recorded_s / plain_s, 4) if plain_s else math.nan}


def measure_rate(rate: float, seconds: float, side: TrainingSide, rounds: int, seed: int,
                 warmup_seconds: float = 0.0) -> dict:
    trace = make_trace(rate, seconds, seed)
    # (a warm-up too short to draw an arrival still sends one request: else the first server
    # serves its first, cold request in the measured trace)
    warmup = make_trace(rate, warmup_seconds, seed + 1000, at_least_one=True) if warmup_seconds else None
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for round_index in range(rounds):
        for variant in ((False, True) if round_index % 2 == 0 else (True, False)):
            result = run_condition(variant, side, trace, seed, seconds, warmup)
            runs[variant].append(result)
            name = side.compare + (" on " if variant else " off")
            print(f"  rate {rate:.2f}/s round {round_index + 1}/{rounds} {name}: "
                  f"TPOT mean {result['tpot_mean_s'] * 1000:.1f} ms p99 {result['tpot_p99_s'] * 1000:.1f} ms, "
                  f"TTFT p50 {result['ttft_p50_s'] * 1000:.0f} ms p99 {result['ttft_p99_s'] * 1000:.0f} ms, "
                  f"server TPOT {result['server_tpot_mean_s'] * 1000:.1f} ms, "
                  f"decode step {result['steps']['decode']['mean_s'] * 1000:.1f} ms, prefill per token: plain "
                  f"{result['steps']['prefill']['s_per_token'] * 1000:.2f} ms alone, "
                  f"{result['steps']['mixed']['s_per_token'] * 1000:.2f} ms beside decodes; recorded "
                  f"{result['steps']['recorded_prefill']['s_per_token'] * 1000:.2f} ms alone, "
                  f"{result['steps']['recorded_mixed']['s_per_token'] * 1000:.2f} ms beside decodes "
                  f"({result['steps']['recorded_prefill']['page_faults_per_step']:.0f}, "
                  f"{result['steps']['recorded_mixed']['page_faults_per_step']:.0f} page faults per step), "
                  f"CPU per token: event loop {result['event_loop_cpu_per_token_ms']:.2f} ms, "
                  f"device thread {result['device_cpu_per_token_ms']:.2f} ms, "
                  + (f"cold TPOT {result['cold_tpot_mean_s'] * 1000:.1f} ms, " if warmup else "")
                  + f"trained {result['train_tokens_per_s']:.1f} tok/s during the trace"
                  + (f" ({result['train_tokens_by_the_end']:.0f} tokens, {result['optimizer_steps_by_the_end']:.0f} "
                     "optimizer steps once caught up)" if result["training"] else "")
                  + (f", by path {result['trained_by_path']}, longest slice "
                     + (f"{result['train_slice_max_s'] * 1000:.0f} ms ({result['train_slice_max_item']})"
                        if result["train_slice_max_item"] else f"<= {result['train_slice_max_s'] * 1000:.0f} ms")
                     if result["training"] else ""), flush=True)

    def median(variant: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs[variant])

    summary = {"compare": side.compare, "rate": rate, "seconds": seconds, "policy": side.policy,
               "tpot_slo_ms": side.tpot_slo_ms,
               "train_config": side.config_file, "feedback": side.feedback,
               "feedback_fraction": side.feedback_fraction, "rounds": rounds, "requests": len(trace)}
    for key in ("tpot_mean_s", "tpot_p99_s", "ttft_p50_s", "ttft_p99_s"):
        summary[f"off_{key}"] = round(median(False, key), 5)
        summary[f"on_{key}"] = round(median(True, key), 5)
    summary["tpot_mean_ratio"] = round(summary["on_tpot_mean_s"] / summary["off_tpot_mean_s"], 4)
    summary["tpot_p99_ratio"] = round(summary["on_tpot_p99_s"] / summary["off_tpot_p99_s"], 4)
    summary["ttft_p99_increase_s"] = round(summary["on_ttft_p99_s"] - summary["off_ttft_p99_s"], 4)
    if warmup:
        summary["warmup_seconds"] = warmup_seconds
        for key in ("tpot_mean_s", "ttft_p50_s"):
            summary[f"off_cold_{key}"] = round(median(False, f"cold_{key}"), 5)
            summary[f"on_cold_{key}"] = round(median(True, f"cold_{key}"), 5)
    for key in ("server_ttft_mean_s", "server_queue_mean_s", "server_prefill_mean_s", "server_tpot_mean_s",
                "server_itl_mean_s", "event_loop_cpu_per_token_ms", "device_cpu_per_token_ms"):
        summary[f"off_{key}"] = round(median(False, key), 5)
        summary[f"on_{key}"] = round(median(True, key), 5)
    summary["server_tpot_mean_ratio"] = round(summary["on_server_tpot_mean_s"] / summary["off_server_tpot_mean_s"], 4)
    for kind in STEP_KINDS:
        for key in ("mean_s", "s_per_token", "page_faults_per_step"):
            for variant, name in ((False, "off"), (True, "on")):
                values = [r["steps"][kind][key] for r in runs[variant] if not math.isnan(r["steps"][kind][key])]
                summary[f"{name}_{kind}_step_{key}"] = round(statistics.median(values), 5) if values else math.nan
    # in the server under the trace: a recorded prefill's seconds per token over a plain
    # one's (the off server's) of the same composition, and a decode step's with training
    # on over off
    summary.update(recorded_over_plain(runs))
    summary["decode_step_ratio"] = round(summary["on_decode_step_mean_s"] / summary["off_decode_step_mean_s"], 4)
    longest = max(runs[True], key=lambda r: r["train_slice_max_s"])
    summary["train_slice_max_s"] = round(longest["train_slice_max_s"], 4)
    summary["train_slice_max_item"] = longest["train_slice_max_item"]
    summary["train_tokens_per_s"] = round(median(True, "train_tokens_per_s"), 2)
    summary["between_step_slices"] = median(True, "between_step_slices")
    trained = {path: sum(r["trained_by_path"][path] for r in runs[True]) for path in TRAINING_PATHS}
    summary["trained_by_path"] = trained
    summary["reuse_share"] = round(reuse_share(trained), 3)
    summary["runs"] = {"off": runs[False], "on": runs[True]}
    return summary


def plot(results: list[dict], path: str) -> str:
    """Against request rate: mean TPOT and p99 TTFT with training off and on, and the
    share of trained entries that reused the served prefill."""
    plt = pyplot()

    rates = [r["rate"] for r in results]
    fig, (tpot, ttft, reuse) = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, label in ((tpot, "tpot_mean_s", "mean time per output token (ms)"),
                           (ttft, "ttft_p99_s", "p99 time to first token (ms)")):
        ax.plot(rates, [r[f"off_{key}"] * 1000 for r in results], "s-", color="tab:red", label="training off")
        ax.plot(rates, [r[f"on_{key}"] * 1000 for r in results], "o-", color="tab:blue",
                label=f"training on ({results[0]['policy']})")
        ax.set_xlabel("request rate (requests / s)")
        ax.set_ylabel(label)
        ax.legend(loc="upper left")
    if results[0]["policy"] == "slo":
        tpot.axhline(results[0]["tpot_slo_ms"], color="gray", linestyle="--", label="TPOT SLO")
    tpot.set_title("Serving latency with online training (cf. paper Fig. 10)")
    reuse.plot(rates, [r["reuse_share"] * 100 for r in results], "o-", color="tab:green")
    reuse.set_ylim(0, 105)
    reuse.set_xlabel("request rate (requests / s)")
    reuse.set_ylabel("entries trained on the served prefill (%)")
    reuse.set_title("Reuse share")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_colocate_bench(side: TrainingSide, rate: float, seconds: float, rounds: int = 2, seed: int = 0,
                       json_path: str | None = None, sweep: list[float] | None = None,
                       plot_path: str | None = None, warmup_seconds: float = 0.0) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would drown the progress
    results = [measure_rate(r, seconds, side, rounds, seed, warmup_seconds) for r in (sweep or [rate])]
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "runs"}))
    out = {"results": results}
    if sweep:
        out["plot"] = plot(results, plot_path or f"bench-colocate-{side.policy}.png")
    write_json(out if sweep else results[0], json_path)
    return out
