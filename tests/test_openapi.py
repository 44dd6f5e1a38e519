"""The OpenAPI document against the live server: every route documents its request and
response bodies and its error statuses, and schemathesis fuzzes every operation (valid
and invalid bodies, bounded examples, small `max_tokens`): no 5xx, every status, content
type and body as documented, every schema-invalid body refused. The app serves exactly
the route table, and each configuration's document offers only what that server takes."""

import pytest
import schemathesis
from hypothesis import HealthCheck, example, given, settings
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 positive_data_acceptance, response_schema_conformance, status_code_conformance)
from schemathesis.generation import GenerationMode

from server.openapi import Offered, served_operations
from server.route_table import OPERATIONS
from tests.servers import TINY_NAME, ServerThread, tiny_app
from tests.tiny import tiny_tokenizer
from trainer.config import AdapterConfig, TrainConfig

# the live server takes preferences and saves adapters, so every route can succeed
LIVE_OPERATIONS = served_operations(Offered(feedback="preference", rollback=True, adapters=True, stores=True,
                                                   responses=True))


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    # DPO on and adapters saved, so that feedback and the adapter routes answer as in production
    adapter = AdapterConfig(dir=str(tmp_path_factory.mktemp("adapters")))
    with ServerThread(tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=adapter)) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(live_server):
    return schemathesis.openapi.from_url(live_server.url + "/openapi.json")


# how many tokens one fuzzed request may ask for (generation is what costs time here)
MAX_FUZZ_TOKENS = 4
# a request here takes milliseconds; the limit only keeps a hung server from hanging the run
REQUEST_TIMEOUT_S = 300


def bounded(body):
    """Caps what a fuzzed body may generate, without making an invalid body valid (the
    document names the served model: an unknown one is a body to refuse)."""
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if type(body.get(name)) is int and body[name] > MAX_FUZZ_TOKENS:
                body[name] = MAX_FUZZ_TOKENS
        if type(body.get("n")) is int and 2 < body["n"] <= 128:
            body["n"] = 2
        if "max_tokens" not in body and "max_completion_tokens" not in body and "messages" in body:
            body["max_tokens"] = MAX_FUZZ_TOKENS
        if "max_output_tokens" not in body and "input" in body:
            body["max_output_tokens"] = MAX_FUZZ_TOKENS
    return body


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
# operations whose every schema-valid request is accepted (a 404 for an unknown version is
# an acceptance); the others also refuse what a schema cannot say (a tool message without
# its call's id, an empty prompt, a preference that gives neither side)
ACCEPTING = {("post", "/v1/adapters/rollback"), ("post", "/detokenize")} | {
    key for key in LIVE_OPERATIONS if key[0] in ("get", "delete")}


# one body of each that the server must accept, sent with the fuzzed ones: what the fuzzer
# builds varies between runs, and in one run every chat body it built was refused (400), so
# the success responses were not checked against the document
VALID_BODIES = {"/v1/chat/completions": {"model": TINY_NAME, "max_tokens": 3,
                                         "messages": [{"role": "user", "content": "Hi"}]},
                "/v1/completions": {"model": TINY_NAME, "max_tokens": 3, "prompt": "Hi"},
                "/v1/responses": {"model": TINY_NAME, "max_output_tokens": 3, "input": "Hi"},
                "/detokenize": {"model": TINY_NAME, "tokens": [5, 6]}}


FUZZED = [(method, path, mode) for method, path in sorted(LIVE_OPERATIONS) for mode in GenerationMode
          # a route without a body has nothing schema-invalid to send
          if mode is GenerationMode.POSITIVE or LIVE_OPERATIONS[method, path].request is not None]


@pytest.mark.slow  # tens of requests per operation
@pytest.mark.parametrize("method, path, mode", FUZZED, ids=lambda v: getattr(v, "value", v))
def test_the_server_answers_as_its_schema_says(api_schema, live_server, method, path, mode):
    operation = api_schema[path][method.upper()]
    statuses = []

    @given(case=operation.as_strategy(generation_mode=mode))
    # derandomized (hypothesis's own choices are fixed); what schemathesis builds from them
    # still varied between runs (a streamed body was sent in one CI run and in none of six
    # here), so streams are also checked by a fixed test below
    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        case.body = bounded(case.body)
        checks = CHECKS + ([positive_data_acceptance] if (method, path) in ACCEPTING else [])
        # schemathesis's own timeout is 10 s, which a loaded 2-core machine has exceeded
        response = case.call_and_validate(base_url=live_server.url, checks=checks, timeout=REQUEST_TIMEOUT_S)
        statuses.append(response.status_code)
        refusals.append((case.body, response.text[:300]))

    refusals = []
    if mode is GenerationMode.POSITIVE and path in VALID_BODIES:
        fuzz = example(case=operation.Case(body=dict(VALID_BODIES[path])))(fuzz)
    fuzz()
    if mode is GenerationMode.POSITIVE and path in VALID_BODIES:
        assert 200 in statuses, (statuses, refusals[:5])  # successful bodies were checked too, not only errors


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 3}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 3}),
])
def test_a_stream_answers_as_its_schema_says(api_schema, live_server, path, body):
    """Every server-sent event of a stream is checked against the document (schemathesis
    validates each event; fuzzing reaches `"stream": true` only in some runs)."""
    case = api_schema[path]["POST"].Case(body={"model": TINY_NAME, "stream": True, **body})
    response = case.call_and_validate(base_url=live_server.url, checks=CHECKS, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200 and response.headers["content-type"][0].startswith("text/event-stream")


def test_every_post_route_documents_its_body_and_errors(live_server):
    import httpx

    document = httpx.get(live_server.url + "/openapi.json", timeout=REQUEST_TIMEOUT_S).json()
    assert {(method, path) for path, methods in document["paths"].items() for method in methods} \
        == set(LIVE_OPERATIONS)
    for (method, path), spec in LIVE_OPERATIONS.items():
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
    n = next(option for option in chat["properties"]["n"]["anyOf"] if option["type"] == "integer")
    assert (n["minimum"], n["maximum"]) == (1, 128)  # or null, as OpenAI's schema has it: the default
    # what the server refuses across fields, where a schema can say it: a tool result without its call's id,
    # a turn other than an assistant's without content, and both chat template controls sent true
    tool_result, content = document["components"]["schemas"]["ChatMessage"]["allOf"]
    assert {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}} in tool_result["anyOf"]
    assert {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}} in content["anyOf"]
    for name in ("ChatCompletionRequest", "TokenizeChatRequest"):
        both = document["components"]["schemas"][name]["not"]
        assert set(both["required"]) == {"add_generation_prompt", "continue_final_message"}
    # a completion's prompt is never empty, in any of its forms, at any depth
    prompt = document["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert [(form.get("minLength"), form.get("minItems"), form.get("items", {}).get("minLength"),
             form.get("items", {}).get("minItems")) for form in prompt] == [
        (1, None, None, None), (None, 1, 1, None), (None, 1, None, None), (None, 1, None, 1)]
    token_id = document["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert token_id == {"type": "integer", "minimum": 0, "maximum": len(tiny_tokenizer()) - 1}
    # the served names, in every request that names a model and in GET /v1/models/{model_id}
    schemas = document["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "TokenizePromptRequest", "DetokenizeRequest"):
        model = schemas[name]["properties"]["model"]
        assert [branch.get("enum") for branch in model.get("anyOf", [model]) if branch["type"] == "string"] == [
            [TINY_NAME]], name
    (model_id,) = document["paths"]["/v1/models/{model_id}"]["get"]["parameters"]
    assert model_id["schema"]["enum"] == [TINY_NAME]
    # the tool controls need tools (none or null do not), and a suffix is empty, as the server refuses otherwise
    needs_tools = schemas["ChatCompletionRequest"]
    assert needs_tools["then"] == {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}
    assert {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": [None, "none"]}}}} \
        in needs_tools["if"]["anyOf"]
    assert "if" not in schemas["TokenizeChatRequest"]  # it has no tool controls
    assert {"maxLength": 0, "type": "string"} in schemas["CompletionRequest"]["properties"]["suffix"]["anyOf"]


def test_the_tool_controls_and_a_suffix_are_refused_or_taken_as_the_document_says(live_server):
    import httpx

    base = {"model": TINY_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    for extra, status in (({"parallel_tool_calls": False}, 400), ({"tool_choice": "required"}, 400),
                          ({"tool_choice": "none", "parallel_tool_calls": None}, 200),
                          ({"tools": [], "tool_choice": "none"}, 200)):
        r = httpx.post(live_server.url + "/v1/chat/completions", json={**base, **extra}, timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == status, (extra, r.text)
    for suffix, status in (("", 200), (None, 200), ("x", 400)):
        r = httpx.post(live_server.url + "/v1/completions", json={"model": TINY_NAME, "prompt": "Hi", "max_tokens": 1,
                                                                  "suffix": suffix}, timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == status, (suffix, r.text)


def test_an_integer_may_be_written_without_a_fraction_only(live_server):
    """JSON (and JSON Schema's `integer`) does not tell 2 from 2.0; 2.5 and "2" stay refused."""
    import httpx

    def ask(**fields):
        return httpx.post(live_server.url + "/v1/completions",
                          json={"model": TINY_NAME, "prompt": "Hi", "max_tokens": 2, **fields},
                          timeout=REQUEST_TIMEOUT_S)

    accepted = ask(n=2.0, max_tokens=3.0, seed=7.0)
    assert accepted.status_code == 200, accepted.text
    assert len(accepted.json()["choices"]) == 2
    for bad in ({"n": 2.5}, {"n": "2"}, {"n": True}, {"max_tokens": 1.5}):
        refused = ask(**bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == next(iter(bad)), refused.text


@pytest.mark.parametrize("prompt, param", [("", "prompt"), ([""], "prompt"), (["Hi", ""], "prompt[1]"),
                                           ([], "prompt"), ([[]], "prompt"), ([[5], []], "prompt[1]")])
def test_an_empty_prompt_in_any_form_is_refused_as_the_schema_says(live_server, prompt, param):
    import httpx

    refused = httpx.post(live_server.url + "/v1/completions", json={"model": TINY_NAME, "prompt": prompt},
                         timeout=REQUEST_TIMEOUT_S)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"] | {"message": None} == {
        "message": None, "type": "invalid_request_error", "param": param, "code": "invalid_value"}


def test_the_app_serves_exactly_the_route_table():
    """No route undocumented, none documented that the app lacks (HEAD routes repeat GET's)."""
    routes = [route for route in tiny_app().state.api_routes if route.include_in_schema]
    assert {(method.lower(), route.path_format) for route in routes for method in route.methods} == set(OPERATIONS)


@pytest.mark.parametrize("mode, saves, offered", [
    ("off", False, Offered(feedback=None, rollback=False, adapters=False, responses=True)),
    ("cpt", True, Offered(feedback=None, rollback=True, adapters=True, stores=True, responses=True)),
    ("dpo", False, Offered(feedback="preference", rollback=False, adapters=True, stores=True, responses=True)),
    ("grpo", True, Offered(feedback="rewards", rollback=True, adapters=True, stores=True, responses=True)),
])
def test_the_document_offers_only_what_this_server_takes(tmp_path, mode, saves, offered):
    """A route that answers 400 to every valid request on this server is left out (feedback
    without a method that takes labels, rollback without an adapter directory, the adapter
    with training off), and feedback documents the one label the method takes."""
    adapter = AdapterConfig(dir=str(tmp_path)) if saves else None
    document = tiny_app(train=TrainConfig(mode=mode, lora_rank=4), adapter=adapter).openapi()
    documented = {(method, path) for path, methods in document["paths"].items() for method in methods}
    assert documented == set(served_operations(offered))
    if offered.feedback is not None:
        body = document["paths"]["/v1/feedback"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        refs = [choice["$ref"] for choice in body.get("oneOf", [body])]
        schemas = [document["components"]["schemas"][ref.rsplit("/", 1)[-1]] for ref in refs]
        if offered.feedback == "preference":  # texts (at least one side), or two choices by index
            texts, indices = schemas
            assert "rewards" not in texts["properties"] and texts["required"] == ["id"]
            assert texts["anyOf"] == [{"required": ["chosen"]}, {"required": ["rejected"]}]
            assert set(indices["required"]) == {"id", "chosen_index", "rejected_index"}
        else:
            [rewards] = schemas
            assert set(rewards["properties"]) == {"id", "rewards"} and set(rewards["required"]) == {"id", "rewards"}


def test_the_output_limits_minimum_is_in_the_document():
    """A chat answer has at least one token (OpenAI's minimum); a completion may have none
    (it scores its prompt with `echo`): a fuzzer sends neither a refused value as valid."""
    from server.protocol import ChatCompletionRequest, CompletionRequest

    def minimum(model, field):
        return next(a["minimum"] for a in model.model_json_schema()["properties"][field]["anyOf"] if "minimum" in a)

    assert {minimum(ChatCompletionRequest, field) for field in ("max_tokens", "max_completion_tokens",
                                                                "max_new_tokens")} == {1}
    assert minimum(CompletionRequest, "max_tokens") == minimum(CompletionRequest, "max_new_tokens") == 0


@pytest.mark.parametrize("keys, secured", [
    ({}, set()),
    ({"admin_key": "sk-admin"}, {"/v1/adapters", "/v1/adapters/rollback"}),
    ({"api_key": "sk-x"}, "every /v1 route"),
    ({"api_key": "sk-x", "admin_key": "sk-admin"}, "every /v1 route"),
])
def test_the_document_asks_a_key_of_the_routes_the_server_asks_one_of(tmp_path, keys, secured):
    """An outside pass with schemathesis: with only an admin key, the document said every
    `/v1/*` route took a key and might answer 401, where `/v1/models` answers anyone. And a
    body past the limit is 413 on every route (checked from its Content-Length), a GET too."""
    from server.config import ServerConfig

    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=AdapterConfig(dir=str(tmp_path)),
                   server=ServerConfig(**keys))
    document = app.openapi()
    asked = {path for path, methods in document["paths"].items() for op in methods.values() if "security" in op}
    answers_401 = {path for path, methods in document["paths"].items() for op in methods.values()
                   if "401" in op["responses"]}
    if secured == "every /v1 route":
        secured = {path for path in document["paths"] if path.startswith("/v1/")}
    assert asked == answers_401 == secured
    assert ("securitySchemes" in document.get("components", {})) == bool(secured)
    assert all("413" in op["responses"] for methods in document["paths"].values() for op in methods.values())
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        for path in sorted(p for p in document["paths"] if "{" not in p and "get" in document["paths"][p]):
            assert (client.get(path).status_code == 401) == (path in secured), path


@pytest.mark.parametrize("field, inside, outside", [
    ("temperature", 2, 2.01), ("top_p", 1, 0), ("min_p", 0, -0.1), ("presence_penalty", -2, -2.5),
    ("frequency_penalty", 2, 2.5), ("repetition_penalty", 0.01, 0), ("top_k", -1, -2), ("top_k", 0, -3),
    ("logprobs", 20, 21), ("seed", 2**63 - 1, 2**63), ("min_tokens", 0, -1), ("stop", ["a"] * 16, ["a"] * 17),
    ("stop", "", [""]), ("logit_bias", {"5": 100}, {"5": 101}), ("logit_bias", {"5": 1}, {"x": 1}),
    ("truncate_prompt_tokens", -1, 0), ("guided_choice", ["a"], []),
])
def test_a_sampling_parameters_range_is_the_documents(live_server, field, inside, outside):
    """An outside pass with schemathesis: the document gave the sampling parameters no
    range, so values the server refuses were "valid" (`top_p` 0, `temperature` 2.5). Each
    side of each bound: the document and the server agree."""
    import httpx
    import jsonschema

    document = httpx.get(live_server.url + "/openapi.json").json()
    schema = {"$ref": "#/components/schemas/CompletionRequest", "components": document["components"]}
    for value, valid in ((inside, True), (outside, False)):
        body = {"model": TINY_NAME, "prompt": "Hi", "max_tokens": 1, field: value}
        documented = jsonschema.Draft202012Validator(schema).is_valid(body)
        status = httpx.post(live_server.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S).status_code
        assert (documented, status == 200) == (valid, valid), (value, status)
