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


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_object_output_is_an_object(client, temperature):
    r = chat(client, {"type": "json_object"}, temperature=temperature, seed=1, n=4, max_tokens=120)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
    {"type": "json_schema", "json_schema": {"name": "my schema!", "schema": {}}},  # OpenAI's names: [a-zA-Z0-9_-]
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
        prompt = torch.tensor([encode("Answer in JSON.")], device=engine.runner.device)
        logits = engine.model(prompt).logits[0, -1].float()
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


# -- vLLM's extras: regex, choice, grammar, json -------------------------------------------

def _content(r) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("field", ["structured_outputs", "guided"])
def test_choice_regex_and_grammar_hold_at_temperature_one(client, field):
    specs = {"choice": ["positive", "negative", "neutral"], "regex": r"[A-Z][a-z]{2,5}-\d{3}",
             "grammar": 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'}
    checks = {"choice": lambda text: text in specs["choice"],
              "regex": lambda text: __import__("re").fullmatch(specs["regex"], text) is not None,
              "grammar": lambda text: __import__("re").fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", text) is not None}
    for kind, spec in specs.items():
        extra = {"structured_outputs": {kind: spec}} if field == "structured_outputs" else {f"guided_{kind}": spec}
        r = client.post("/v1/chat/completions", json={
            "model": TINY_NAME, "max_tokens": 30, "temperature": 1.0, "seed": 3, "n": 4,
            "messages": [{"role": "user", "content": "Go."}], **extra})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            if choice["finish_reason"] == "stop":
                assert checks[kind](choice["message"]["content"]), (kind, choice["message"]["content"])
        assert any(c["finish_reason"] == "stop" for c in r.json()["choices"]), kind


def test_a_gbnf_grammar_is_accepted(client):
    r = chat(client, None, structured_outputs={"grammar": 'root ::= "yes" | "no"'})
    assert _content(r) in ("yes", "no")


def test_json_extras_on_text_completions(client):
    for extra in ({"structured_outputs": {"json": SCHEMA}}, {"guided_json": json.dumps(SCHEMA)}):
        r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": "JSON:", "max_tokens": 40,
                                                 "temperature": 0.7, "seed": 5, **extra})
        assert r.status_code == 200, r.text
        value = json.loads(r.json()["choices"][0]["text"])
        assert set(value) == {"answer", "level"}


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_json": [1, 2]}, "guided_json"),
    ({"guided_json": "[" * 1000 + "]" * 1000}, "guided_json"),  # past Python's recursion limit: was a 500
    # no text matches them: they were answered with empty text and finish_reason "stop"
    ({"guided_grammar": "root ::= root"}, "guided_grammar"),
    ({"guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}, "guided_json"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
])
def test_bad_or_conflicting_constraints_are_400_naming_the_field(client, extra, param):
    r = client.post("/v1/chat/completions", json={
        "model": TINY_NAME, "max_tokens": 5, "messages": [{"role": "user", "content": "Go."}], **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def reference_chain(links: int, listed_last_first: bool = False, ref: str = "#/$defs/d{}") -> dict:
    """A schema whose definitions each refer to the next, `links` deep (listed last first:
    each is measured before the one that refers to it; `ref`: how a reference is written,
    `#d{}` by the `$anchor` each definition then has)."""
    definitions = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": ref.format(i + 1)}}} for i in range(links)}
    definitions[f"d{links}"] = {"type": "string"}
    if ref == "#d{}":
        definitions = {name: {**schema, "$anchor": name} for name, schema in definitions.items()}
    order = reversed(definitions.items()) if listed_last_first else definitions.items()
    return {"$id": "http://x.test/s", "$ref": ref.format(0), "$defs": dict(order)}


def rule_chain(rules: int, line_end: str = "\n") -> str:
    return line_end.join(["start: r0", *(f'r{i}: "x" r{i + 1} | "y"' for i in range(rules)), f'r{rules}: "z"'])


def gbnf_chain(rules: int, line_end: str) -> str:
    return line_end.join(["root ::= r0", *(f'r{i} ::= "x" r{i + 1} | "y"' for i in range(rules)),
                          f'r{rules} ::= "z"'])


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": reference_chain(1000)}}},
     "response_format"),
    ({"structured_outputs": {"json": reference_chain(1000)}}, "structured_outputs.json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": reference_chain(1000)}}]},
     "tools[0].function.parameters"),
    ({"structured_outputs": {"grammar": "start: %json " + json.dumps(reference_chain(1000))}},
     "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": rule_chain(3000)}}, "structured_outputs.grammar"),
    # ways around the first checks (a review): definitions listed last first, references
    # written otherwise, GBNF's rules ended by a lone carriage return
    ({"structured_outputs": {"json": reference_chain(1000, listed_last_first=True)}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": reference_chain(1000, ref="#/%24defs/d{}")}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": reference_chain(1000, ref="http://x.test/s#/$defs/d{}")}},
     "structured_outputs.json"),
    ({"structured_outputs": {"json": reference_chain(1000, ref="#d{}")}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"$ref": "http://elsewhere.test/schema.json"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": gbnf_chain(10000, "\r")}}, "structured_outputs.grammar"),
])
def test_a_grammar_whose_compiling_would_overflow_the_stack_is_a_400(client, extra, param):
    """One such request killed the whole server with a segmentation fault (an outside pass:
    llguidance compiles by recursion on the native stack); each of these did, unchecked."""
    r = client.post("/v1/chat/completions", json={
        "model": TINY_NAME, "max_tokens": 5, "messages": [{"role": "user", "content": "Go."}], **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_deep_but_real_schemas_and_grammars_still_compile(client):
    tree = {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}
    for schema in (reference_chain(80), reference_chain(80, listed_last_first=True), tree,
                   reference_chain(40, ref="http://x.test/s#/%24defs/d{}"), reference_chain(40, ref="#d{}")):
        response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        assert chat(client, response_format, max_tokens=5).status_code == 200
    r = client.post("/v1/chat/completions", json={"model": TINY_NAME, "max_tokens": 5, "messages": [
        {"role": "user", "content": "Go."}], "structured_outputs": {"grammar": rule_chain(400)}})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"model": TINY_NAME, "max_tokens": 5, "messages": [
        {"role": "user", "content": "Go."}], "structured_outputs": {"grammar": gbnf_chain(400, "\r\n")}})
    assert r.status_code == 200, r.text


def test_an_error_says_neither_a_panics_backtrace_nor_a_long_value_back(client):
    """llguidance's panic on 70,000 choices came back with its Rust backtrace (build paths), and
    100,000 stop strings were said back whole (a 989 KB error body)."""
    for extra in ({"structured_outputs": {"choice": [f"c{i}" for i in range(70000)]}}, {"stop": ["ab"] * 100000}):
        r = client.post("/v1/chat/completions", json={
            "model": TINY_NAME, "max_tokens": 5, "messages": [{"role": "user", "content": "Go."}], **extra})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "\n" not in message and len(message) < 600, message


def test_a_requests_grammar_is_compiled_once(client, monkeypatch):
    """Checked off the event loop, its matcher is the one choice 0 decodes with (the engine's
    thread compiled it a second time, for seconds with a large grammar, while every stream waited)."""
    from engine.structured import GrammarCompiler

    compiled = []
    matcher = GrammarCompiler.matcher
    monkeypatch.setattr(GrammarCompiler, "matcher", lambda self, grammar: compiled.append(grammar) or
                        matcher(self, grammar))
    r = chat(client, {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}, n=3, temperature=1.0)
    assert r.status_code == 200 and len(compiled) == 1, r.text
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "stop":  # (a document max_tokens cut does not parse)
            assert set(json.loads(choice["message"]["content"])) == {"answer", "level"}
    r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": ["a", "b"], "max_tokens": 40,
                                             "structured_outputs": {"json": SCHEMA}})
    assert r.status_code == 200 and len(compiled) == 2, r.text
    assert all(set(json.loads(c["text"])) == {"answer", "level"} for c in r.json()["choices"]
               if c["finish_reason"] == "stop")
