"""The decode step of servers with training off and on, under a closed workload instead of
the Poisson trace: is a decode step slower because the server trains? Run from the
repository root:

    .venv/bin/python docs/training-issue24/decode_step_servers.py --conditions off,on-labelled,on,off
    PYTHONPATH=docs/training-issue24/step_times .venv/bin/python docs/training-issue24/decode_step_servers.py \
        --conditions on,on-labelled,on,on-labelled --stagger --step-times

Each condition starts its own server (one at a time: `off` is `--train-mode off`, `on` is
`--train-mode dpo` with no label sent, `on-labelled` the same with a DPO label posted for
every answer as soon as it ends) and sends `--rounds` pairs of concurrent chat requests,
an idle gap after each pair (where the labelled server trains). With `--stagger` the two
requests of a pair have different lengths (48 and 144 tokens), so that the shorter one's
label arrives while the other still decodes. The decode step's mean is read from the
server's own `serving_step_seconds{kind="decode"}` after two rounds of warm-up.

`--step-times` (with `step_times/` on PYTHONPATH: its `sitecustomize` logs every engine
step's start and length in the server) also splits the labelled server's decode steps
into those that overlapped a label's POST (± 50 ms) and the others.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

MODEL = "SmolLM2-135M-Instruct"
STEP_TIMES_DIR = "/tmp/alchemist-step-times"


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def _decode_totals(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=60).read().decode()
    total = re.search(r'serving_step_seconds_sum\{kind="decode"[^}]*\} (\S+)', text)
    count = re.search(r'serving_step_seconds_count\{kind="decode"[^}]*\} (\S+)', text)
    return float(total.group(1)), float(count.group(1))


def _workload(url: str, rounds: int, labelled: bool, stagger: bool) -> tuple[float, int, list]:
    """(mean decode step in s, decode steps, the labels' POST intervals in wall time)."""
    posts: list[tuple[float, float]] = []

    def request(index: int) -> None:
        tokens = (48 if index % 2 == 0 else 144) if stagger else 96
        answer = _post(url + "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": f"Tell me a story about the number {index}."}],
            "max_tokens": tokens, "min_tokens": tokens, "temperature": 0.7})
        if labelled:
            started = time.time()
            _post(url + "/v1/feedback", {"id": answer["id"], "rejected": "No."})
            posts.append((started, time.time()))

    before = None
    for round_index in range(rounds):
        if round_index == 2:
            before = _decode_totals(url)
        pair = [threading.Thread(target=request, args=(2 * round_index + k,)) for k in range(2)]
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join()
        time.sleep(4)
    after = _decode_totals(url)
    steps = after[1] - before[1]
    return (after[0] - before[0]) / steps, int(steps), posts


def _overlap_split(pid: int, posts: list) -> dict:
    """The server's decode steps that overlapped a label's POST (± 50 ms) and the others."""
    with open(f"{STEP_TIMES_DIR}/steps-{pid}.json") as log:
        steps = json.load(log)
    decodes = [(start, length) for start, length, kind in steps if kind == "decode"]
    decodes = decodes[len(decodes) // 10:]  # past the warm-up

    def near(start: float, length: float) -> bool:
        return any(a - 0.05 <= start + length and start <= b + 0.05 for a, b in posts)

    split = {"during_labels": [d for s, d in decodes if near(s, d)], "other": [d for s, d in decodes if not near(s, d)]}
    return {key: {"steps": len(values), "mean_ms": round(1000 * statistics.mean(values), 2) if values else None}
            for key, values in split.items()}


def run_condition(condition: str, port: int, rounds: int, stagger: bool, step_times: bool) -> dict:
    mode = "off" if condition == "off" else "dpo"
    log = open(f"/tmp/decode-step-servers-{port}.log", "w")
    env = dict(os.environ, ALCHEMIST_STEP_TIMES="1" if step_times else "0", ALCHEMIST_STEP_TIMES_DIR=STEP_TIMES_DIR)
    server = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--train-mode", mode, "--port", str(port)],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        mean, steps, posts = _workload(url, rounds, condition == "on-labelled", stagger)
        result = {"condition": condition, "decode_step_ms": round(1000 * mean, 2), "decode_steps": steps}
        if step_times and posts:
            time.sleep(3.5)  # the server writes its step log every 3 s
            result["overlap"] = _overlap_split(server.pid, posts)
        return result
    finally:
        server.terminate()
        server.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conditions", default="off,on-labelled,on,off")
    parser.add_argument("--rounds", type=int, default=14)
    parser.add_argument("--stagger", action="store_true")
    parser.add_argument("--step-times", action="store_true")
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--json")
    args = parser.parse_args()
    os.makedirs(STEP_TIMES_DIR, exist_ok=True)
    for old in glob.glob(f"{STEP_TIMES_DIR}/steps-*.json"):
        os.remove(old)
    results = []
    for index, condition in enumerate(args.conditions.split(",")):
        results.append(run_condition(condition, args.port + index, args.rounds, args.stagger, args.step_times))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rounds": args.rounds, "stagger": args.stagger, "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
