"""What holding an answer for its ledger commit costs a request: the tiny Llama served with
DPO training and an adapter directory (the ledger on this machine's disk), chat requests
(n = 2, 16 tokens) one after another, rounds alternating between the answer held until the
ledger holds it (the default) and not held (`ANSWER_WRITE_WAIT_S = 0`). Prints the wait
itself and the median client latency per condition. Run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/ledger-answer-wait/answer_wait.py [--rounds 6] [--requests 20]
"""

import argparse
import statistics
import tempfile
import time

from fastapi.testclient import TestClient

import engine.async_engine as async_engine
from tests.servers import TINY_NAME, tiny_app
from trainer.config import AdapterConfig, TrainConfig

BODY = {"model": TINY_NAME, "max_tokens": 16, "ignore_eos": True, "n": 2, "temperature": 1.0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    waits: list[float] = []
    held = async_engine.AsyncEngine._answer_written

    async def timed(self, request_id):
        started = time.perf_counter()
        await held(self, request_id)
        waits.append(time.perf_counter() - started)

    async_engine.AsyncEngine._answer_written = timed
    latency = {"held": [], "not held": []}
    with tempfile.TemporaryDirectory() as root:
        app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=AdapterConfig(dir=root))
        with TestClient(app) as client:
            for _ in range(5):
                client.post("/v1/chat/completions", json=BODY)
            for round_ in range(args.rounds):
                condition = "held" if round_ % 2 == 0 else "not held"
                async_engine.ANSWER_WRITE_WAIT_S = 2.0 if condition == "held" else 0.0
                waits.clear()
                for _ in range(args.requests):
                    started = time.perf_counter()
                    assert client.post("/v1/chat/completions", json=BODY).status_code == 200
                    latency[condition].append(time.perf_counter() - started)
                if condition == "held":
                    print(f"round {round_}: wait median {statistics.median(waits) * 1e3:.2f} ms, "
                          f"max {max(waits) * 1e3:.2f} ms")
    medians = {k: statistics.median(v) * 1e3 for k, v in latency.items()}
    print(f"median latency: held {medians['held']:.1f} ms, not held {medians['not held']:.1f} ms, "
          f"ratio {medians['held'] / medians['not held']:.3f}")


if __name__ == "__main__":
    main()
