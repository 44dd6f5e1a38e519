"""Watch the served model learn a made-up fact, over HTTP only.

Start a server that trains on what it serves (continual pre-training on prompts):

    .venv/bin/alchemist serve --train-mode cpt --learning-rate 1e-4

then run this script. It measures how likely the model finds a made-up fact
(`/v1/completions` with echo + logprobs, `"train": false` so that measuring does not
teach), sends the fact in a dozen ordinary chat requests (which the server records and
trains on in its idle time), and measures again.

    .venv/bin/python examples/learn_a_fact.py [--url http://127.0.0.1:8000] [--rounds 12]
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request

FACT = "The capital of the planet Zorblax is Quintaria, founded by Admiral Vexley in 3021."


def post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def get_metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.split()[-1])
    return 0.0


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]


def fact_logprob(url: str, model: str) -> float:
    """Summed log-probability of the fact's tokens (after the first), not trained on."""
    out = post(url, "/v1/completions", {"model": model, "prompt": FACT, "max_tokens": 0, "echo": True,
                                         "logprobs": 0, "train": False})
    return sum(v for v in out["choices"][0]["logprobs"]["token_logprobs"] if v is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    model = served_model(args.url)
    before = fact_logprob(args.url, model)
    print(f"log p(fact) before: {before:8.2f} nats")
    start_version = get_metric(args.url, "alchemist:adapter_version")
    for i in range(args.rounds):
        post(args.url, "/v1/chat/completions", {"model": model, "max_tokens": 8,
                                                 "messages": [{"role": "user", "content": FACT}]})
        target = start_version + i + 1
        deadline = time.time() + 60
        while get_metric(args.url, "alchemist:adapter_version") < target and time.time() < deadline:
            time.sleep(0.05)  # training runs when the server is idle; wait for this step
        print(f"  round {i + 1:2d}/{args.rounds}: adapter version "
              f"{int(get_metric(args.url, 'alchemist:adapter_version'))}, "
              f"log p(fact) {fact_logprob(args.url, model):8.2f}", flush=True)
    after = fact_logprob(args.url, model)
    print(f"log p(fact) after:  {after:8.2f} nats  (+{after - before:.2f})")


if __name__ == "__main__":
    main()
