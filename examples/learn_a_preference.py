"""Watch the served model learn a preference from feedback, over HTTP only.

Start a server that trains on preferences (DPO from `POST /v1/feedback`):

    .venv/bin/alchemist serve --train-mode dpo --learning-rate 1e-4

then run this script. For each training question it asks the server, and answers with
feedback that prefers the same answer opened by a marker ("Certainly! …") over the one
served. It measures how likely the model is to open its answer with the marker on
questions it never trained on, before and after (`/v1/completions` with echo + logprobs
on the chat-formatted prompt, `"train": false` so that measuring does not teach).

    .venv/bin/python examples/learn_a_preference.py [--url http://127.0.0.1:8000] [--rounds 24]

The prompt format is ChatML (`<|im_start|>role ... <|im_end|>`), the embedded model's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learn_a_fact import get_metric, post, served_model  # noqa: E402 - the examples' HTTP helpers

MARKER = "Certainly!"
TRAIN = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
    "List three fruits and their colors.", "How do I boil an egg?", "What is 17 times 23?",
    "Name a famous painter.", "Why is the sky blue?", "Give me a tip for learning Python.",
    "What does a compiler do?", "Describe a cat in two sentences.", "What is photosynthesis?",
    "Suggest a name for a bakery.", "How far is the Moon?", "What is the largest ocean?", "Tell me a fun fact.",
    "How many legs does a spider have?", "What is the boiling point of water?", "Who wrote Hamlet?",
    "What is a prime number?", "How do plants drink water?", "What is the speed of light?",
    "Recommend a good book.", "What language is spoken in Brazil?",
]
HELD_OUT = ["What is the tallest mountain on Earth?", "How do bees make honey?", "What is an atom?",
            "Why do leaves change color in autumn?", "How does a rainbow form?", "What is the capital of Japan?"]


def chatml(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def marker_logprob(url: str, model: str, question: str, marker: str = MARKER) -> float:
    """log p(the answer opens with the marker | the question), not trained on."""
    out = post(url, "/v1/completions", {"model": model, "prompt": chatml(question) + marker, "max_tokens": 0,
                                         "echo": True, "logprobs": 0, "train": False})
    logprobs = out["choices"][0]["logprobs"]
    text, total = "", 0.0
    for token, value in zip(reversed(logprobs["tokens"]), reversed(logprobs["token_logprobs"])):
        text, total = token + text, total + value
        if text.endswith(marker) and len(text) >= len(marker):
            return total
    raise RuntimeError(f"the marker's tokens were not found in {logprobs['tokens'][-8:]}")


def held_out_logprob(url: str, model: str, marker: str = MARKER) -> float:
    """Mean over the held-out questions."""
    return sum(marker_logprob(url, model, q, marker) for q in HELD_OUT) / len(HELD_OUT)


def wait_for_version(url: str, target: float, timeout_s: float = 120.0) -> None:
    deadline = time.time() + timeout_s
    while get_metric(url, "alchemist:adapter_version") < target:
        if time.time() > deadline:
            raise TimeoutError(f"adapter version {target} not reached in {timeout_s} s")
        time.sleep(0.05)  # training runs when the server is idle


def teach(url: str, model: str, rounds: int) -> None:
    start_version = get_metric(url, "alchemist:adapter_version")
    for i in range(rounds):
        question = TRAIN[i % len(TRAIN)]
        reply = post(url, "/v1/chat/completions", {"model": model, "max_tokens": 16, "temperature": 0,
                                                    "messages": [{"role": "user", "content": question}]})
        served = reply["choices"][0]["message"]["content"]
        # the served answer is the rejected side when only "chosen" is given
        post(url, "/v1/feedback", {"id": reply["id"], "chosen": f"{MARKER} {served}"})
        wait_for_version(url, start_version + i + 1)
        print(f"  round {i + 1:2d}/{rounds}: adapter version {int(get_metric(url, 'alchemist:adapter_version'))}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--rounds", type=int, default=24)
    args = parser.parse_args()
    model = served_model(args.url)
    before = held_out_logprob(args.url, model)
    print(f"held-out log p({MARKER!r} opens the answer) before: {before:7.2f} nats")
    teach(args.url, model, args.rounds)
    after = held_out_logprob(args.url, model)
    print(f"held-out log p({MARKER!r} opens the answer) after:  {after:7.2f} nats  ({after - before:+.2f})")


if __name__ == "__main__":
    main()
