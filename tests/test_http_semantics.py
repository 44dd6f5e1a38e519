"""HTTP semantics schema-driven clients rely on: 405 says which methods are allowed,
HEAD works where GET does, /metrics is documented as text."""

import pytest
from fastapi.testclient import TestClient

from tests.servers import tiny_app


@pytest.fixture(scope="module")
def client():
    with TestClient(tiny_app()) as c:
        yield c


@pytest.mark.parametrize("method, path, allow", [("GET", "/v1/chat/completions", "POST"),
                                                 ("DELETE", "/health", "GET, HEAD"),
                                                 ("GET", "/v1/feedback", "POST")])
def test_405_names_the_allowed_methods(client, method, path, allow):
    r = client.request(method, path)
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == set(allow.split(", "))
    assert r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models"])
def test_head_works_where_get_does(client, path):
    assert client.head(path).status_code == 200


def test_metrics_are_documented_as_text(client):
    schema = client.get("/openapi.json").json()
    content = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert content and all(c.startswith("text/plain") for c in content)
