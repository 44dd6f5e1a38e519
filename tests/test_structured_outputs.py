"""Structured outputs over the real app, on a tiny random model: whatever the model
prefers, the output parses and validates (`response_format` json_object / json_schema);
a schema that cannot be enforced is a 400 naming `response_format`; the recorded
log-probs stay the model's own."""

import json

import pytest
import torch
from fastapi.testclient import TestClient

from engine.sampling_params import SamplingParams
from engine.structured import json_schema_grammar
from tests.conftest import encode, make_engine
from tests.servers import TINY_NAME, tiny_app

SCHEMA = {"type": "object", "properties": {"answer": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
          "required": ["answer", "level"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client():
    with TestClient(tiny_app()) as c:
        yield c


def chat(client, response_format, **extra):
    return client.post("/v1/chat/completions", json={
        "model": TINY_NAME, "max_tokens": 40, "messages": [{"role": "user", "content": "Answer in JSON."}],
        "response_format": response_format, **extra})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(client, temperature):
    r = chat(client, {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}},
             temperature=temperature, seed=1, n=3)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"answer", "level"}
        assert isinstance(value["answer"], bool) and value["level"] in ("low", "high")
        assert choice["finish_reason"] == "stop"


def test_json_object_output_is_an_object(client):
    r = chat(client, {"type": "json_object"}, temperature=0.0, max_tokens=60)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert content.lstrip().startswith("{")
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
    {"type": "yaml"},
])
def test_unenforceable_formats_are_400_naming_response_format(client, response_format):
    r = chat(client, response_format)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("response_format")


def test_recorded_logprobs_are_the_models_own_not_the_masked_ones():
    engine = make_engine()
    grammar = json_schema_grammar(SCHEMA)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, grammar=grammar)
    engine.add_request("r", encode("Answer in JSON."), params)
    constrained = []
    while engine.has_unfinished():
        for out in engine.step()[0]:
            constrained += out.outputs[0].logprobs
    # the first token's reported log-prob, against the unconstrained distribution at the same position
    with torch.inference_mode():
        logits = engine.model(torch.tensor([encode("Answer in JSON.")])).logits[0, -1].float()
    expected = logits.log_softmax(-1)[constrained[0].token_id].item()
    assert constrained[0].logprob == pytest.approx(expected, abs=1e-4)
    assert expected < 0  # a forced token is not reported as certain


def test_the_openai_sdk_parses_a_structured_output():
    """`client.chat.completions.parse` with a pydantic model: the SDK's own strict schema."""
    from typing import Literal

    import openai
    import pydantic

    from tests.servers import ServerThread

    class Verdict(pydantic.BaseModel):
        answer: bool
        level: Literal["low", "high"]

    with ServerThread(tiny_app()) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        completion = client.chat.completions.parse(
            model=TINY_NAME, messages=[{"role": "user", "content": "Answer in JSON."}], response_format=Verdict,
            max_tokens=40, temperature=0)
    assert isinstance(completion.choices[0].message.parsed, Verdict)
