"""Watch the served model learn from rewards on groups of its own samples (GRPO), over HTTP only.

Start a server that trains on groups (`--train-mode grpo`):

    .venv/bin/alchemist serve --train-mode grpo --learning-rate 1e-3

then run this script. For each training question it asks the server for n = 8 answers
at temperature 1 (`--temperature`) over the whole distribution (top_p 1, whatever the model's generation
config recommends: diverse answers are what GRPO compares) and rewards each one by a rule it can check itself: 1 if the answer
opens with the word "The", else 0 (`POST /v1/feedback {"id", "rewards": [...]}`). A
group whose answers all score the same teaches nothing and is skipped by the server.
It measures how likely the model is to open its answer with "The" on questions it never
trained on, before and after (`/v1/completions` with echo + logprobs, `"train": false`).

    .venv/bin/python examples/learn_from_rewards.py [--url http://127.0.0.1:8000] [--rounds 24] [--temperature 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learn_a_fact import get_metric, post, served_model  # noqa: E402 - the examples' HTTP helpers
from learn_a_preference import TRAIN, held_out_logprob, wait_for_version  # noqa: E402

OPENING = "The"
GROUP = 8


def reward(answer: str) -> float:
    """The verifiable rule: does the answer open with the word?"""
    words = answer.strip().split()
    return 1.0 if words and words[0].strip("\"'*,.:") == OPENING else 0.0


def teach(url: str, model: str, rounds: int, group: int = GROUP, temperature: float = 1.0) -> dict[str, int]:
    counts = {"accepted": 0, "skipped": 0}
    for i in range(rounds):
        question = TRAIN[i % len(TRAIN)]
        # seeded: the adapter moves only between rounds (each waits for its training), so a run repeats exactly
        reply = post(url, "/v1/chat/completions", {"model": model, "n": group, "temperature": temperature, "top_p": 1.0,
                                                    "max_tokens": 8, "seed": i,
                                                    "messages": [{"role": "user", "content": question}]})
        answers = [choice["message"]["content"] for choice in sorted(reply["choices"], key=lambda c: c["index"])]
        rewards = [reward(a) for a in answers]
        version = get_metric(url, "alchemist:adapter_version")
        status = post(url, "/v1/feedback", {"id": reply["id"], "rewards": rewards})["status"]
        counts[status] += 1
        if status == "accepted":
            wait_for_version(url, version + 1)
        print(f"  round {i + 1:2d}/{rounds}: rewards {rewards} -> {status}; adapter version "
              f"{int(get_metric(url, 'alchemist:adapter_version'))}", flush=True)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--group", type=int, default=GROUP, help="answers per question (n)")
    parser.add_argument("--temperature", type=float, default=1.0, help="the answers' sampling temperature")
    args = parser.parse_args()
    model = served_model(args.url)
    before = held_out_logprob(args.url, model, OPENING)
    print(f"held-out log p({OPENING!r} opens the answer) before: {before:7.2f} nats")
    counts = teach(args.url, model, args.rounds, args.group, args.temperature)
    after = held_out_logprob(args.url, model, OPENING)
    print(f"groups trained {counts['accepted']}, skipped (equal rewards) {counts['skipped']}")
    print(f"held-out log p({OPENING!r} opens the answer) after:  {after:7.2f} nats  ({after - before:+.2f})")


if __name__ == "__main__":
    main()
