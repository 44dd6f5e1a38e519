"""How long other clients wait while one request's CPU work runs: a `/health` probe's and
a 2-token chat's latency while a 4 MB prompt is tokenized (`/tokenize`, open without a key)
and while a 60,000-choice grammar compiles, on a server at the tree this runs from.

    .venv/bin/python docs/outside-passes-2026-11-30/loop_held.py --port 8051 [--json out.json]
"""

import argparse
import json
import subprocess
import sys
import threading
import time

import httpx

MODEL = "SmolLM2-135M-Instruct"


def probe_while(url: str, heavy: dict, route: str) -> dict:
    """The longest /health and chat latencies while `heavy` is posted to `route`."""
    done = threading.Event()
    answer = {}

    def send():
        answer["status"] = httpx.post(f"{url}{route}", json=heavy, timeout=300).status_code
        done.set()

    worker = threading.Thread(target=send)
    worker.start()
    time.sleep(0.3)  # its body sent and its work begun
    health, chat = [], []
    while not done.is_set():
        started = time.perf_counter()
        httpx.get(f"{url}/health", timeout=300)
        health.append(time.perf_counter() - started)
        started = time.perf_counter()
        httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        chat.append(time.perf_counter() - started)
    worker.join()
    return {"status": answer["status"], "health_max_s": round(max(health, default=0), 3),
            "chat_max_s": round(max(chat, default=0), 3), "probes": len(health)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8051)
    parser.add_argument("--json")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(args.port),
                               "--log-level", "WARNING"])
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        report = {
            "tokenize_4mb": probe_while(url, {"model": MODEL, "prompt": "hello world, this is some text. " * 125000},
                                        "/tokenize"),
            "choices_60k": probe_while(url, {"model": MODEL, "messages": [{"role": "user", "content": "Pick."}],
                                             "max_tokens": 2, "structured_outputs": {"choice": [
                                                 f"choice-{i}-with-some-padding-to-be-long" for i in range(60000)]}},
                                       "/v1/chat/completions"),
        }
    finally:
        server.terminate()
        server.wait(60)
    print(json.dumps(report))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
