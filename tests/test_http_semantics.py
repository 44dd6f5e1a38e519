"""HTTP semantics schema-driven clients rely on: 405 says which methods are allowed,
HEAD works where GET does, /metrics is documented as text, a body not sent as JSON is
refused."""

import json

import pytest
from fastapi.testclient import TestClient

from server.parsing import is_json_media_type
from trainer.config import AdapterConfig, TrainConfig
from tests.servers import TINY_NAME, tiny_app


@pytest.fixture(scope="module")
def client():
    with TestClient(tiny_app()) as c:
        yield c


@pytest.mark.parametrize("method, path, allow", [("GET", "/v1/chat/completions", "POST"),
                                                 ("DELETE", "/health", "GET, HEAD"),
                                                 ("GET", "/v1/feedback", "POST"),
                                                 ("POST", "/v1/responses/resp_0123", "GET, HEAD, DELETE"),
                                                 ("DELETE", "/v1/responses/resp_0123/input_items", "GET, HEAD")])
def test_405_names_the_allowed_methods(client, method, path, allow):
    r = client.request(method, path)
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == set(allow.split(", "))
    message = r.json()["error"]["message"]
    assert f"Method {method} is not allowed" in message and allow.split(", ")[0] in message


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models"])
def test_head_works_where_get_does(client, path):
    assert client.head(path).status_code == 200


def test_metrics_are_documented_as_text(client):
    schema = client.get("/openapi.json").json()
    content = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert content and all(c.startswith("text/plain") for c in content)


@pytest.mark.parametrize("content_type, is_json", [(None, False), ("", False), ("application/json", True),
                                                   ("Application/JSON; charset=utf-8", True),
                                                   ("application/merge-patch+json", True), ("text/plain", False),
                                                   ("application/x-www-form-urlencoded", False),
                                                   ("multipart/form-data; boundary=x", False), ("text/json+x", False)])
def test_which_media_types_are_json(content_type, is_json):
    assert is_json_media_type(content_type) is is_json


def test_a_body_sent_as_a_form_or_text_is_refused_before_it_acts(tmp_path):
    """A web page may send a form, text or a body of no named type (a Blob's) to another
    origin without asking first; read as JSON, such a body could label, train or roll back
    the server of whoever opened it."""
    train = TrainConfig(mode="dpo", lora_rank=4)
    with TestClient(tiny_app(train=train, adapter=AdapterConfig(dir=str(tmp_path), save_every=1))) as client:
        chat = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2}
        served = client.post("/v1/chat/completions", json=chat)
        assert served.status_code == 200
        bodies = {"/v1/chat/completions": chat, "/v1/completions": {"model": TINY_NAME, "prompt": "hi"},
                  "/v1/feedback": {"id": served.json()["id"], "chosen_index": 0, "rejected_index": 1},
                  "/v1/adapters/rollback": {"version": 0}, "/tokenize": {"model": TINY_NAME, "prompt": "hi"},
                  "/detokenize": {"model": TINY_NAME, "tokens": [1]}}
        documented = client.get("/openapi.json").json()["paths"]
        for path, body in bodies.items():
            for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
                headers = {"content-type": content_type} if content_type else {}
                refused = client.post(path, content=json.dumps(body), headers=headers)
                assert refused.status_code == 415, (path, content_type)
                assert refused.json()["error"]["code"] == "unsupported_media_type"
            assert "415" in documented[path]["post"]["responses"], path
        labelled = client.post("/v1/feedback", content=json.dumps(bodies["/v1/feedback"]),
                               headers={"content-type": "application/json; charset=utf-8"})
        assert labelled.status_code == 200, labelled.text


@pytest.mark.parametrize("escape", ["\\ud800", "\\udc00", "\\ud800\\u0041"])
def test_a_lone_surrogate_escape_is_a_400_that_says_what_it_is(client, escape):
    """An outside pass: Python's json takes "\\ud800", and the 400 said only "unexpected
    end of hex escape"."""
    body = '{"model": "%s", "messages": [{"role": "user", "content": "a%sb"}]}' % (TINY_NAME, escape)
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert "half a character" in r.json()["error"]["message"]
    pair = '{"model": "%s", "max_tokens": 1, "messages": [{"role": "user", "content": "\\ud83d\\ude42"}]}' % TINY_NAME
    r = client.post("/v1/chat/completions", content=pair, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text  # a pair makes a character


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": ["f"]}, "tools[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": 5},
     "stream_options"),
    ("/v1/chat/completions", {"messages": ["hi"]}, "messages[0]"),
    ("/tokenize", {"prompt": "hi", "model": TINY_NAME, "extra": 1}, "extra"),
])
def test_a_field_that_should_be_an_object_is_named(client, path, body, param):
    """An outside pass: any object field sent as something else was "The request body must be
    a JSON object", naming no field; only the body itself is that."""
    r = client.post(path, json={"model": TINY_NAME, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for whole in ("[1]", "5", '"x"'):
        r = client.post(path, content=whole, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
