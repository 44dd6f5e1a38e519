"""Randomly mutated request bodies never get a 5xx or FastAPI's 422: always 200 or an
OpenAI-style 4xx (seeded, so a failure reproduces)."""

import json
import random

import pytest
from fastapi.testclient import TestClient

from trainer.config import AdapterConfig, TrainConfig
from tests.servers import TINY_NAME, tiny_app

pytestmark = pytest.mark.slow  # hundreds of requests

VALUES = [None, True, False, 0, -1, 1, 2.5, -1e9, 1e308, 10**30, "", "x", "hot", [], [1], ["a"], [[1, 2]], {},
          {"type": "text"}, {"include_usage": True}, [{"role": "user"}], [{"role": "user", "content": 5}],
          [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], [{"role": "system", "content": None}],
          "\u0000", "🙂" * 3, [-5], [10**12], {"5": 1}, {"a": 1}, {"1": 1e9}]
FIELDS = ["id", "chosen", "rejected", "choice_index", "version", "model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
          "stream", "stream_options", "logprobs", "top_logprobs", "echo", "presence_penalty", "min_tokens",
          "stop_token_ids", "logit_bias", "response_format", "best_of", "ignore_eos", "unknown_field", "max_completion_tokens"]


def mutate(rng: random.Random, base: dict) -> bytes:
    body = dict(base)
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(FIELDS)
        if rng.random() < 0.2:
            body.pop(field, None)
        else:
            body[field] = rng.choice(VALUES)
    text = json.dumps(body)
    if rng.random() < 0.1:
        text = text[: rng.randint(0, len(text))]
    return text.encode()


@pytest.mark.parametrize("route, base", [
    ("/v1/chat/completions", {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/completions", {"model": TINY_NAME, "prompt": "hi", "max_tokens": 2}),
    ("/v1/responses", {"model": TINY_NAME, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2,
                       "instructions": "Be brief."}),
])
def test_fuzzed_bodies_never_get_a_server_error(route, base):
    rng = random.Random(route)
    with TestClient(tiny_app(), raise_server_exceptions=False) as client:
        for _ in range(150):
            payload = mutate(rng, base)
            r = client.post(route, content=payload, headers={"content-type": "application/json"})
            assert r.status_code in (200, 400, 404), (payload, r.status_code, r.text)
            if r.status_code != 200:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, payload


def test_fuzzed_feedback_and_rollback_bodies_never_get_a_server_error(tmp_path):
    """The training routes, on a DPO server that saves adapters (so every branch is live)."""
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=AdapterConfig(dir=str(tmp_path)))
    rng = random.Random("training routes")
    with TestClient(app, raise_server_exceptions=False) as client:
        served = client.post("/v1/chat/completions", json={"model": TINY_NAME, "max_tokens": 3,
                                                           "messages": [{"role": "user", "content": "hi"}]})
        bases = [("/v1/feedback", {"id": served.json()["id"], "chosen": "yes"}),
                 ("/v1/adapters/rollback", {"version": 0})]
        for i in range(150):
            route, base = bases[i % 2]
            payload = mutate(rng, base)
            r = client.post(route, content=payload, headers={"content-type": "application/json"})
            assert r.status_code in (200, 400, 404, 409), (route, payload, r.status_code, r.text)
            if r.status_code != 200:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, payload
