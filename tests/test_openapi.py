"""The OpenAPI document against the live server: every route documents its request and
response bodies and its error statuses, and schemathesis fuzzes every operation (valid
and invalid bodies, bounded examples, small `max_tokens`): no 5xx, every status, content
type and body as documented, every schema-invalid body refused."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)
from schemathesis.generation import GenerationMode

from server.openapi import OPERATIONS
from tests.servers import TINY_NAME, ServerThread, tiny_app
from tests.tiny import tiny_tokenizer
from trainer.config import TrainConfig


@pytest.fixture(scope="module")
def live_server():
    # DPO on, so that feedback and the adapter routes answer as in production
    with ServerThread(tiny_app(train=TrainConfig(mode="dpo", lora_rank=4))) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(live_server):
    return schemathesis.openapi.from_url(live_server.url + "/openapi.json")


# how many tokens one fuzzed request may ask for (generation is what costs time here)
MAX_FUZZ_TOKENS = 4


def bounded(body):
    """Names the served model and caps what a fuzzed body may generate, without making
    an invalid body valid."""
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = TINY_NAME
        for name in ("max_tokens", "max_completion_tokens"):
            if type(body.get(name)) is int and body[name] > MAX_FUZZ_TOKENS:
                body[name] = MAX_FUZZ_TOKENS
        if type(body.get("n")) is int and 2 < body["n"] <= 128:
            body["n"] = 2
        if "max_tokens" not in body and "max_completion_tokens" not in body and "messages" in body:
            body["max_tokens"] = MAX_FUZZ_TOKENS
    return body


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


FUZZED = [(method, path, mode) for method, path in sorted(OPERATIONS) for mode in GenerationMode
          # a route without a body has nothing schema-invalid to send
          if mode is GenerationMode.POSITIVE or OPERATIONS[method, path].request is not None]


@pytest.mark.parametrize("method, path, mode", FUZZED, ids=lambda v: getattr(v, "value", v))
def test_the_server_answers_as_its_schema_says(api_schema, live_server, method, path, mode):
    operation = api_schema[path][method.upper()]
    statuses = []

    @given(case=operation.as_strategy(generation_mode=mode))
    # derandomized: the same examples every run, so CI cannot pass or fail by luck
    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        case.body = bounded(case.body)
        statuses.append(case.call_and_validate(base_url=live_server.url, checks=CHECKS).status_code)

    fuzz()
    if mode is GenerationMode.POSITIVE and path in ("/v1/chat/completions", "/v1/completions", "/detokenize"):
        assert 200 in statuses, statuses  # successful bodies were checked too, not only errors


def test_every_post_route_documents_its_body_and_errors(live_server):
    import httpx

    document = httpx.get(live_server.url + "/openapi.json").json()
    for (method, path), spec in OPERATIONS.items():
        operation = document["paths"][path][method]
        if method == "post":
            body = operation["requestBody"]["content"]["application/json"]["schema"]
            models = spec.request if isinstance(spec.request, tuple) else (spec.request,)
            refs = [ref["$ref"] for ref in body.get("oneOf", [body])]
            assert refs == [f"#/components/schemas/{model.__name__}" for model in models], path
        for status in map(str, spec.errors):
            error = operation["responses"][status]["content"]["application/json"]["schema"]
            assert error["$ref"].endswith("ErrorResponse"), (path, status)
        assert "422" not in operation["responses"], path
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False  # unknown fields are refused, and the schema says so
    assert {"messages", "model"} <= set(chat["required"])
    assert (chat["properties"]["n"]["minimum"], chat["properties"]["n"]["maximum"]) == (1, 128)
    token_id = document["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert token_id == {"type": "integer", "minimum": 0, "maximum": len(tiny_tokenizer()) - 1}


def test_an_integer_may_be_written_without_a_fraction_only(live_server):
    """JSON (and JSON Schema's `integer`) does not tell 2 from 2.0; 2.5 and "2" stay refused."""
    import httpx

    def ask(**fields):
        return httpx.post(live_server.url + "/v1/completions",
                          json={"model": TINY_NAME, "prompt": "Hi", "max_tokens": 2, **fields}, timeout=60)

    accepted = ask(n=2.0, max_tokens=3.0, seed=7.0)
    assert accepted.status_code == 200, accepted.text
    assert len(accepted.json()["choices"]) == 2
    for bad in ({"n": 2.5}, {"n": "2"}, {"n": True}, {"max_tokens": 1.5}):
        refused = ask(**bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == next(iter(bad)), refused.text
