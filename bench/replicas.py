"""`alchemist bench replicas`: N data-parallel replicas against one, over HTTP, with
training on.

Each condition starts `alchemist serve --train-mode dpo --data-parallel-size R` on the
embedded model (one thread per replica, `OMP_NUM_THREADS=1`) and drives it closed-loop:
`--clients` clients, each asking a question, sending the preference of learn_a_preference
("Certainly! " + the served answer, over it) as soon as the answer is back, and asking
the next, until `--requests` answers are labelled — the same labels in every condition.
Every request opens a connection of its own, as a crowd of clients would: the kernel
spreads connections over the replicas (SO_REUSEPORT), not requests.

Reported per condition: serving tokens/s (generated tokens over the time the clients
ran), trained entries/s (labelled entries over the time until the last one trained), the
server's mean TPOT and TTFT from `/metrics` (summed over the `engine` label), the
share of entries trained on their recorded prefill, the cores the server and the client
used, how the requests spread over the replicas, whether the replicas' adapter digests were equal at
every version seen on more than one replica (polled while it ran), and the held-out
learning check: how much more likely the model opens an answer to questions it never
trained on with the marker, before vs after (`/v1/completions` echo + logprobs through
the shared port). Conditions alternate in rounds; the ratios are R replicas over one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.launch import server_process
from bench.report import read_metric, reuse_share, trained_by_path, write_json
from trainer.replicated import Replica

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from learn_a_preference import MARKER, TRAIN, held_out_logprob  # noqa: E402 - the held-out check users run

DIGEST_POLL_S = 0.5
logging.getLogger("httpx").setLevel(logging.WARNING)


async def _client(url: str, model: str, questions: list[str], max_tokens: int, counts: dict,
                  feedback: bool) -> None:
    while questions:
        question = questions.pop()
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:  # a connection per request
            reply = (await client.post("/v1/chat/completions", json={
                "model": model, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": question}]})).json()
        served = reply["choices"][0]["message"]["content"]
        counts["tokens"] += reply["usage"]["completion_tokens"]
        rank = str(Replica(0, 1 << 16).owner_of(reply["id"]))  # the rank its id names (0: a single server)
        counts["by_replica"][rank] = counts["by_replica"].get(rank, 0) + 1
        if not feedback:
            continue
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            r = await client.post("/v1/feedback", json={"id": reply["id"], "chosen": f"{MARKER} {served}"})
        counts["labelled"] += r.status_code == 200


async def _watch_digests(url: str, stop: asyncio.Event, seen: dict) -> None:
    """Every replica's (version, digest), polled until `stop`."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while not stop.is_set():
            for card in (await client.get("/v1/adapters")).json().get("replicas", []):
                seen.setdefault(card["version"], {})[card["rank"]] = card["digest"]
            await asyncio.sleep(DIGEST_POLL_S)


def _cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds the processes have used (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def _server_pids(launcher: int) -> list[int]:
    """The server's processes: the launcher and, with replicas, its replica children."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    return [launcher, *(int(pid) for pid in children)]


def _trained(text: str) -> float:
    return read_metric(text, "alchemist:trained_entries_total")


async def _drive(url: str, requests: int, clients: int, max_tokens: int, server_pids: list[int],
                 feedback: bool) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        before = (await client.get("/metrics")).text
    questions = [TRAIN[i % len(TRAIN)] + f" ({i})" for i in range(requests)]
    counts = {"tokens": 0, "labelled": 0, "by_replica": {}}
    seen: dict = {}
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_digests(url, stop, seen))
    started, client_cpu, server_cpu = time.perf_counter(), time.process_time(), _cpu_seconds(server_pids)
    await asyncio.gather(*(_client(url, model, questions, max_tokens, counts, feedback) for _ in range(clients)))
    serving_s = time.perf_counter() - started
    client_cpu, server_cpu = time.process_time() - client_cpu, _cpu_seconds(server_pids) - server_cpu
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while True:  # until every label trained
            text = (await client.get("/metrics")).text
            if _trained(text) - _trained(before) >= counts["labelled"] or time.perf_counter() - started > 900:
                break
            await asyncio.sleep(0.5)
    training_s = time.perf_counter() - started
    stop.set()
    await watcher
    shared = {v: d for v, d in seen.items() if len(d) > 1}

    def mean(histogram: str) -> float:
        count = read_metric(text, f"{histogram}_count") - read_metric(before, f"{histogram}_count")
        return (read_metric(text, f"{histogram}_sum") - read_metric(before, f"{histogram}_sum")) / max(count, 1)

    return {"serving_s": serving_s, "training_s": training_s, "generated_tokens": counts["tokens"],
            "labelled": counts["labelled"], "trained": _trained(text) - _trained(before),
            "tokens_per_s": counts["tokens"] / serving_s,
            "trained_per_s": counts["labelled"] / training_s if feedback else None,
            "client_cores": client_cpu / serving_s, "server_cores": server_cpu / serving_s,
            "server_tpot_ms": 1000 * mean("alchemist:request_time_per_output_token_seconds"),
            "server_ttft_ms": 1000 * mean("alchemist:time_to_first_token_seconds"),
            "trained_by_path": trained_by_path(text, "dpo", before),
            "reuse_share": reuse_share(trained_by_path(text, "dpo", before)) if feedback else None,
            "requests_by_replica": counts["by_replica"], "versions_seen_on_several_replicas": len(shared),
            "digests_equal": all(len(set(d.values())) == 1 for d in shared.values())}


def _run_server(replicas: int, flags: list[str], requests: int, clients: int, max_tokens: int,
                training: bool) -> dict:
    with server_process(*flags, "--data-parallel-size", str(replicas), env={"OMP_NUM_THREADS": "1"}) \
            as (url, launcher):
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        before = held_out_logprob(url, model)
        result = asyncio.run(_drive(url, requests, clients, max_tokens, _server_pids(launcher.pid), training))
        result["held_out_gain"] = held_out_logprob(url, model) - before
        result["replicas"] = replicas
    return result


def run_condition(replicas: int, requests: int, clients: int, max_tokens: int, learning_rate: float,
                  training: bool = True) -> dict:
    with tempfile.TemporaryDirectory() as adapter_dir:
        train = ["--train-mode", "dpo", "--learning-rate", str(learning_rate), "--adapter-dir", adapter_dir] \
            if training else ["--train-mode", "off"]
        result = _run_server(replicas, train, requests, clients, max_tokens, training)
    trained = f"{result['trained_per_s']:.2f} trained entries/s (reuse share {result['reuse_share']:.0%}), " \
        if training else ""
    print(f"  {replicas} replica(s): {result['tokens_per_s']:.1f} tokens/s, {trained}TPOT "
          f"{result['server_tpot_ms']:.1f} ms, held-out gain {result['held_out_gain']:+.2f} nats, cores used: "
          f"server {result['server_cores']:.2f}, client {result['client_cores']:.2f}; requests by replica "
          f"{result['requests_by_replica']}, digests equal: {result['digests_equal']} "
          f"({result['versions_seen_on_several_replicas']} versions)", flush=True)
    return result


def run_replicas_bench(replicas: int, requests: int, clients: int, max_tokens: int, rounds: int,
                       learning_rate: float, json_path: str | None, training: bool = True) -> dict:
    """`training` False: serving alone (no feedback), what the CPU allows without training."""
    runs: dict[int, list[dict]] = {1: [], replicas: []}
    for round_index in range(rounds):
        print(f"round {round_index + 1}/{rounds}", flush=True)
        for count in (1, replicas) if round_index % 2 == 0 else (replicas, 1):
            runs[count].append(run_condition(count, requests, clients, max_tokens, learning_rate, training))

    def median(count: int, key: str) -> float:
        return statistics.median(r[key] for r in runs[count])

    report = {"replicas": replicas, "requests": requests, "clients": clients, "max_tokens": max_tokens,
              "learning_rate": learning_rate, "training": training, "runs": runs,
              "tokens_per_s_ratio": median(replicas, "tokens_per_s") / median(1, "tokens_per_s"),
              "digests_equal": all(r["digests_equal"] for r in runs[replicas])}
    summary = f"{replicas} replicas over 1: serving tokens/s {report['tokens_per_s_ratio']:.2f}x"
    if training:
        report["trained_per_s_ratio"] = median(replicas, "trained_per_s") / median(1, "trained_per_s")
        report["held_out_gain"] = {1: median(1, "held_out_gain"), replicas: median(replicas, "held_out_gain")}
        summary += (f", trained entries/s {report['trained_per_s_ratio']:.2f}x; held-out gain "
                    f"{report['held_out_gain'][1]:+.2f} (1) vs {report['held_out_gain'][replicas]:+.2f} "
                    f"({replicas}); digests equal: {report['digests_equal']}")
    print(summary, flush=True)
    write_json(report, json_path)
    return report
