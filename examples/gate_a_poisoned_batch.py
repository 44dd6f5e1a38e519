"""Watch the eval gate stop a poisoned batch of labels, and let benign feedback through, over HTTP only.

Start a server that trains on preferences behind the gate, with the capital-city probes:

    .venv/bin/alchemist serve --train-mode dpo --learning-rate 5e-4 --eval-set examples/capital_probes.jsonl

then run this script. It measures the served model's preference for the right capital over
a wrong one on the probes' questions (log-prob margin, `/v1/completions` with echo +
logprobs, `"train": false`). Then it sends labels that prefer wrong capitals, phrased
unlike the probes ("Which city is X's capital?" answered with a wrong city), and waits
for the trainer: without the gate these move the probes' margin most of the way to zero;
with it, the versions they make are rejected (most of them: a version whose batch moved
the probes less than the tolerance is promoted) and their labels quarantined, and the
served margin moves little. Last it sends benign feedback (the "Certainly!" preference of
learn_a_preference.py) and checks that it is promoted and learned.

    .venv/bin/python examples/gate_a_poisoned_batch.py [--url http://127.0.0.1:8000] [--poison 16] [--benign 24]

Without `--eval-set` on the server the same script shows what the poison does unchecked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learn_a_fact import post, served_model  # noqa: E402 - the examples' HTTP helpers
from learn_a_preference import held_out_logprob, marker_logprob, teach  # noqa: E402

PROBES = [json.loads(line) for line in (Path(__file__).parent / "capital_probes.jsonl").read_text().splitlines()]
WRONG_CAPITALS = [("France", "Lyon"), ("Japan", "Osaka"), ("Italy", "Milan"), ("Germany", "Munich"),
                  ("Spain", "Barcelona"), ("Canada", "Toronto"), ("Australia", "Sydney"), ("Brazil", "Rio de Janeiro"),
                  ("Turkey", "Istanbul"), ("India", "Mumbai"), ("China", "Shanghai"), ("Switzerland", "Zurich"),
                  ("the United States", "New York"), ("Russia", "Saint Petersburg"), ("Morocco", "Casablanca"),
                  ("Vietnam", "Ho Chi Minh City")]


def adapters(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/adapters", timeout=60) as response:
        return json.loads(response.read())


def probe_margin(url: str, model: str) -> float:
    """Mean over the preference probes of log p(chosen) − log p(rejected), as served."""
    margins = [marker_logprob(url, model, p["messages"][0]["content"], p["chosen"])
               - marker_logprob(url, model, p["messages"][0]["content"], p["rejected"])
               for p in PROBES if "chosen" in p]
    return sum(margins) / len(margins)


def settle(url: str, trained_before: int, labels: int, timeout_s: float = 600.0) -> dict:
    """Waits until `labels` more entries are trained and no candidate waits for its verdict."""
    deadline = time.time() + timeout_s
    while True:
        status = adapters(url)
        gate = status.get("gate") or {}
        if status["training"]["trained_entries"] >= trained_before + labels and gate.get("candidate_version") is None:
            return status
        if time.time() > deadline:
            raise TimeoutError("training did not settle")
        time.sleep(0.2)


def poison(url: str, model: str, count: int) -> None:
    for i in range(count):
        country, wrong = WRONG_CAPITALS[i % len(WRONG_CAPITALS)]
        reply = post(url, "/v1/chat/completions", {"model": model, "max_tokens": 16, "temperature": 0, "messages": [
            {"role": "user", "content": f"Which city is {country}'s capital?"}]})
        post(url, "/v1/feedback", {"id": reply["id"], "chosen": f"{wrong} is the capital of {country}."})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--poison", type=int, default=16)
    parser.add_argument("--benign", type=int, default=24)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    url, model = args.url, served_model(args.url)
    figures = {"margin_before": probe_margin(url, model), "marker_before": held_out_logprob(url, model)}
    print(f"probes' margin (right over wrong capital) before: {figures['margin_before']:+.2f} nats")
    start = adapters(url)
    poison(url, model, args.poison)
    after_poison = settle(url, start["training"]["trained_entries"], args.poison)
    figures["margin_after_poison"] = probe_margin(url, model)
    gate = after_poison.get("gate")
    print(f"after {args.poison} poisoned labels: margin {figures['margin_after_poison']:+.2f} nats; serving version "
          f"{after_poison['version']}; " + (f"{gate['rejected']} versions rejected, {gate['promoted']} promoted, "
                                             f"{gate['quarantined_labels']} labels quarantined" if gate else "no gate"))
    teach(url, model, args.benign)
    after_benign = settle(url, after_poison["training"]["trained_entries"], args.benign)
    figures["margin_after_benign"] = probe_margin(url, model)
    figures["marker_after"] = held_out_logprob(url, model)
    gate = after_benign.get("gate")
    print(f"after {args.benign} benign labels: held-out log p('Certainly!') {figures['marker_before']:.2f} -> "
          f"{figures['marker_after']:.2f} nats ({figures['marker_after'] - figures['marker_before']:+.2f}); margin "
          f"{figures['margin_after_benign']:+.2f}; " + (f"{gate['rejected']} rejected, {gate['promoted']} promoted in "
                                                          "all" if gate else "no gate"))
    figures.update(gate=gate, rollbacks=after_benign.get("rollbacks"), serving_version=after_benign["version"])
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
