"""`alchemist bench backlog`: how many entries train on their recordings when labels
arrive faster than idle gaps can train them, and what that does to learning, over HTTP.

A client serves and labels back to back, as a busy user would — it never waits for
training — and then waits until every label has trained:
  - dpo: the 24 questions of examples/learn_a_preference.py, each answered and at once
    given the preference "Certainly! " + the served answer over it; the held-out check is
    that example's (log p of the marker opening answers to questions never trained on);
  - cpt: the made-up fact of examples/learn_a_fact.py served 12 times; the held-out check
    is the fact's log-probability (`"train": false`).
Each condition is a server started with a TOML over the defaults (`--condition
NAME=FILE`); three always run: "strict" (`max_staleness = 0`, steps of 4: every entry not
trained at the version that served it is recomputed at the current one), "steps_of_4"
(`cohort_max_entries = 4`: steps of 4 whatever was recorded under one version, the
default before cohorts) and "default" (the shipped config). Reported per condition:
entries trained by path and the share on their recordings (reuse + stashed), optimizer
steps, the mean adapter versions between serving an entry and training it, the prefills
recorded, the held-out gain and its ratio to strict's, the seconds the client took to
serve and label, and those from the last label to the last entry trained.
`--warm-up N` first trains N labelled answers one at a time (waiting for each), as a
server that has been learning for a while has: from a fresh adapter (LoRA's B = 0) the
first step cannot move A.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.launch import running_server
from bench.report import read_metric, reuse_share, trained_by_path, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import learn_a_fact  # noqa: E402 - the held-out checks users run
import learn_a_preference  # noqa: E402

SCENARIOS = {"dpo": 24, "cpt": 12}
logging.getLogger("httpx").setLevel(logging.WARNING)
# every entry not trained at the version that served it is recomputed at the current one
STRICT = "[train]\nmax_staleness = 0\ncohort_max_entries = 4\n"
# steps of at most `entries_per_step` (4) whatever was recorded under one version: the
# default before cohorts
STEPS_OF_4 = "[train]\ncohort_max_entries = 4\n"


def _serve_and_label(client: httpx.Client, model: str, scenario: str, requests: int, first: int = 0) -> None:
    for i in range(first, first + requests):
        if scenario == "dpo":
            question = learn_a_preference.TRAIN[i % len(learn_a_preference.TRAIN)]
            reply = client.post("/v1/chat/completions", json={
                "model": model, "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": question}]}).json()
            served = reply["choices"][0]["message"]["content"]
            r = client.post("/v1/feedback", json={"id": reply["id"],
                                                  "chosen": f"{learn_a_preference.MARKER} {served}"})
            r.raise_for_status()
        else:
            client.post("/v1/chat/completions", json={
                "model": model, "max_tokens": 8,
                "messages": [{"role": "user", "content": learn_a_fact.FACT}]}).raise_for_status()


def _held_out(url: str, model: str, scenario: str) -> float:
    if scenario == "dpo":
        return learn_a_preference.held_out_logprob(url, model)
    return learn_a_fact.fact_logprob(url, model)


def _wait_trained(client: httpx.Client, mode: str, before: str, requests: int, timeout_s: float) -> str:
    """Polls until `requests` entries have trained; the last scrape."""
    deadline = time.time() + timeout_s
    while True:
        text = client.get("/metrics").text
        if sum(trained_by_path(text, mode, before).values()) >= requests:
            return text
        if time.time() > deadline:
            raise TimeoutError(f"{requests} entries not trained in {timeout_s} s: "
                               f"{trained_by_path(text, mode, before)}")
        time.sleep(0.2)


def _warm_up(client: httpx.Client, model: str, scenario: str, rounds: int, timeout_s: float) -> None:
    """`rounds` labelled answers, each trained before the next is asked for (a server
    that has been learning for a while: the adapter's B is no longer zero)."""
    for i in range(rounds):
        before = client.get("/metrics").text
        _serve_and_label(client, model, scenario, 1, first=i)
        _wait_trained(client, scenario, before, 1, timeout_s)


def run_condition(scenario: str, config_path: str, learning_rate: float, timeout_s: float,
                  warm_up: int = 0) -> dict:
    requests = SCENARIOS[scenario]
    with running_server("--train-mode", scenario, "--learning-rate", str(learning_rate),
                        "--config", config_path) as url:
        client = httpx.Client(base_url=url, timeout=300)
        model = learn_a_fact.served_model(url)
        _warm_up(client, model, scenario, warm_up, timeout_s)
        before_held_out = _held_out(url, model, scenario)
        before = client.get("/metrics").text
        started = time.time()
        _serve_and_label(client, model, scenario, requests, first=warm_up)
        labelled = time.time()
        after = _wait_trained(client, scenario, before, requests, timeout_s)
        drained_s = time.time() - labelled
        gain = _held_out(url, model, scenario) - before_held_out
    paths = trained_by_path(after, scenario, before)
    steps = read_metric(after, "alchemist:adapter_version") - read_metric(before, "alchemist:adapter_version")
    recorded = "alchemist:recorded_prefills_total"
    staleness = {part: read_metric(after, f"alchemist:trained_entry_staleness_{part}")
                 - read_metric(before, f"alchemist:trained_entry_staleness_{part}") for part in ("sum", "count")}
    return {"paths": paths, "reuse_share": round(reuse_share(paths), 3), "optimizer_steps": steps,
            "mean_staleness": round(staleness["sum"] / max(staleness["count"], 1), 3),
            "recorded_prefills": read_metric(after, recorded) - read_metric(before, recorded),
            "gain_nats": round(gain, 3), "seconds_to_serve_and_label": round(labelled - started, 1),
            "seconds_to_train_after_last_label": round(drained_s, 1)}


def run_backlog_bench(scenarios: list[str], conditions: dict[str, str], learning_rate: float = 1e-4,
                      timeout_s: float = 900.0, json_path: str | None = None, warm_up: int = 0) -> dict:
    """Every scenario under strict, default and each named condition (NAME -> TOML)."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name, text in (("strict", STRICT), ("steps_of_4", STEPS_OF_4), ("default", "")):
            runs[name] = str(Path(tmp, f"{name}.toml"))
            Path(runs[name]).write_text(text)
        runs.update(conditions)
        report = {"learning_rate": learning_rate, "warm_up_rounds": warm_up,
                  "conditions": {n: Path(p).read_text() for n, p in runs.items()}, "scenarios": {}}
        for scenario in scenarios:
            rows = {}
            for name, path in runs.items():
                print(f"{scenario}: {name} ...", flush=True)
                rows[name] = row = run_condition(scenario, path, learning_rate, timeout_s, warm_up)
                row["gain_to_strict"] = round(row["gain_nats"] / rows["strict"]["gain_nats"], 3)
                print(f"  {name}: {row}", flush=True)
            report["scenarios"][scenario] = rows
    write_json(report, json_path)
    return report
