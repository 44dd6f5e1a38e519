"""The front door over real HTTP: API keys (with the OpenAI SDK), body limits, 429 on overload."""

import asyncio
import functools
import json
import time

import httpx
import openai
import pytest

from server.config import ServerConfig
from tests.servers import TINY_NAME, ServerThread, tiny_app

KEY = "sk-test-key"
# a request here takes milliseconds; a loaded CI machine may take seconds (httpx's default is 5)
get = functools.partial(httpx.get, timeout=300)
post = functools.partial(httpx.post, timeout=300)


@pytest.fixture(scope="module")
def keyed_server():
    with ServerThread(tiny_app(server=ServerConfig(api_key=KEY, max_body_bytes=64 << 10))) as server:
        yield server


def test_openai_sdk_with_the_key_works_and_without_it_gets_401(keyed_server):
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(model=TINY_NAME, max_tokens=3,
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content is not None
    assert [m.id for m in client.models.list()] == [TINY_NAME]
    for wrong in ("sk-wrong", KEY + "x", ""):
        bad = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=wrong or "unset", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            bad.chat.completions.create(model=TINY_NAME, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"


def test_missing_key_gets_401_with_openai_body_and_probes_stay_open(keyed_server):
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                         ("POST", "/v1/feedback"), ("GET", "/v1/adapters"), ("GET", "/v1/nope")):
        r = httpx.request(method, keyed_server.url + path, json={})
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "missing_api_key" and r.headers["www-authenticate"] == "Bearer"
    r = get(f"{keyed_server.url}/v1/models", headers={"Authorization": f"Basic {KEY}"})
    assert r.status_code == 401  # only Bearer
    assert get(f"{keyed_server.url}/health").status_code == 200
    metrics = get(f"{keyed_server.url}/metrics")
    assert metrics.status_code == 200
    series = 'alchemist:http_requests_total{handler="/v1/chat/completions",status="401"}'
    assert series in metrics.text and f"{series} 0.0" not in metrics.text  # (at 0 from the start)


def test_every_response_carries_a_request_id_the_client_may_choose(keyed_server):
    """OpenAI answers every request with `x-request-id` (the SDK's `.request_id`); a client's
    own short printable X-Request-Id comes back (vLLM's echo), any other gets a new one."""
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model=TINY_NAME, max_tokens=2,
                                                           messages=[{"role": "user", "content": "hi"}])
    first = raw.headers["x-request-id"]
    assert first.startswith("req_") and raw.parse()._request_id == first
    again = client.models.with_raw_response.list().headers["x-request-id"]
    assert again.startswith("req_") and again != first
    mine = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "trace-42"}
    with httpx.stream("POST", f"{keyed_server.url}/v1/completions", headers=mine, timeout=300,
                      json={"model": TINY_NAME, "prompt": "hi", "max_tokens": 2, "stream": True}) as stream:
        assert stream.status_code == 200 and stream.headers["x-request-id"] == "trace-42"
        assert "[DONE]" in "".join(stream.iter_text())
    refused = get(f"{keyed_server.url}/v1/models", headers={"X-Request-Id": "trace-43"})  # no key: 401
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "trace-43"
    for unusable in ("x" * 300, "tab\there"):
        answer = get(f"{keyed_server.url}/health", headers={"X-Request-Id": unusable})
        assert answer.headers["x-request-id"].startswith("req_")
    assert len(get(f"{keyed_server.url}/health").headers.get_list("x-request-id")) == 1


def test_an_unhandled_error_is_a_500_in_openai_format_with_its_request_id():
    from fastapi.testclient import TestClient

    app = tiny_app()

    async def broken():
        raise RuntimeError("a bug")

    app.add_api_route("/broken", broken, methods=["GET"])
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/broken", headers={"X-Request-Id": "trace-500"})
        assert r.status_code == 500 and r.headers["x-request-id"] == "trace-500"
        assert r.json()["error"] == {"message": "internal error: RuntimeError", "type": "server_error",
                                     "param": None, "code": None}
        assert 'alchemist:http_requests_total{handler="other",status="500"} 1.0' in client.get("/metrics").text


def test_a_replicas_question_to_another_is_not_counted_as_a_request():
    """A label forwarded to the replica that served it, or /metrics gathered from every
    replica, is one client request: counted where the client asked, not again where a
    replica asked on its behalf, with server/fanout.py's header on the private port. The
    header on any other port (a client's) is counted."""
    from server.fanout import LOCAL_HEADER
    from server.guards import GuardConfig, RequestGuard

    async def health(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    counted = []
    guard = RequestGuard(health, GuardConfig(replica_port=5002), lambda route, status: counted.append(port))

    async def nothing():
        return {"type": "http.disconnect"}

    async def ignore(message):
        pass

    for port, header in ((5002, True), (8000, True), (5002, False)):
        headers = [(LOCAL_HEADER.encode(), b"1")] if header else []
        scope = {"type": "http", "path": "/health", "headers": headers, "server": ("127.0.0.1", port)}
        asyncio.run(guard(scope, nothing, ignore))
    assert counted == [8000, 5002]
    unreplicated = RequestGuard(health, GuardConfig(), lambda route, status: counted.append("single"))
    asyncio.run(unreplicated({"type": "http", "path": "/health", "headers": [(LOCAL_HEADER.encode(), b"1")],
                              "server": ("127.0.0.1", 5002)}, nothing, ignore))
    assert counted[-1] == "single"


def test_bodies_over_the_limit_get_413(keyed_server):
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    big = json.dumps({"model": TINY_NAME, "prompt": "x " * (40 << 10), "max_tokens": 1})
    r = post(f"{keyed_server.url}/v1/completions", content=big, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(80):
            yield b" " * 1024
    r = post(f"{keyed_server.url}/v1/completions", content=chunks(), headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = post(f"{keyed_server.url}/v1/completions", headers=headers,
                   json={"model": TINY_NAME, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200  # the server is fine afterwards


def test_admin_key_guards_the_adapter_routes_only():
    config = ServerConfig(api_key=KEY, admin_key="sk-admin")
    with ServerThread(tiny_app(server=config)) as server:
        user, admin = {"Authorization": f"Bearer {KEY}"}, {"Authorization": "Bearer sk-admin"}
        assert get(f"{server.url}/v1/adapters", headers=user).status_code == 401
        # training is off here: the admin gets through to the route's own explanation
        r = get(f"{server.url}/v1/adapters", headers=admin)
        assert r.status_code == 400 and r.json()["error"]["code"] == "adapters_not_used"
        assert get(f"{server.url}/v1/models", headers=user).status_code == 200
        assert get(f"{server.url}/v1/models", headers=admin).status_code == 401


def test_overload_gets_429_beside_200_and_never_a_5xx():
    app = tiny_app(max_num_seqs=2, server=ServerConfig(max_queued_requests=2))
    with ServerThread(app) as server:
        body = {"model": TINY_NAME, "prompt": "hello", "max_tokens": 150, "ignore_eos": True, "temperature": 0}

        async def burst():
            async with httpx.AsyncClient(timeout=300) as client:
                return await asyncio.gather(*[client.post(f"{server.url}/v1/completions", json=body)
                                              for _ in range(16)])

        responses = asyncio.run(burst())
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) == {200, 429}, statuses
        assert statuses.count(200) >= 4  # the 2 running + 2 queued were served
        rejected = next(r for r in responses if r.status_code == 429)
        assert rejected.json()["error"]["code"] == "rate_limit_exceeded" and rejected.headers["retry-after"] == "1"
        assert rejected.content == json.dumps(rejected.json(), separators=(",", ":")).encode()  # as other errors
        with pytest.raises(openai.RateLimitError):  # what the SDK makes of it (checked while full)
            asyncio.run(_sdk_during_burst(server.url, body, app.state.alchemist.engine.engine))
        # capacity comes back once the burst is over
        assert post(f"{server.url}/v1/completions", json={**body, "max_tokens": 2}).status_code == 200


async def _sdk_during_burst(url: str, body: dict, engine):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    async with httpx.AsyncClient(timeout=300) as http:
        # 2 running + 2 queued: full while the longest possible answers decode
        holders = [asyncio.ensure_future(http.post(f"{url}/v1/completions", json={**body, "max_tokens": 240}))
                   for _ in range(4)]
        deadline = time.monotonic() + 120
        while engine.num_requests < 4:  # all four admitted (however slow this machine is today)
            assert time.monotonic() < deadline, engine.num_requests
            await asyncio.sleep(0.005)
        try:
            await client.completions.create(model=TINY_NAME, prompt="hi", max_tokens=2)
        finally:
            await asyncio.gather(*holders)


def test_capacity_counts_sequences_so_one_request_of_many_prompts_or_choices_cannot_pass_the_queue_bound():
    """max_num_seqs + max_queued_requests bounds sequences, as the engine queues them: a
    request of 60 prompts (or n = 64) used to count as one and hold the engine."""
    app = tiny_app(max_num_seqs=2, server=ServerConfig(max_queued_requests=2))
    with ServerThread(app) as server:
        body = {"model": TINY_NAME, "max_tokens": 2, "ignore_eos": True, "temperature": 0}
        r = post(f"{server.url}/v1/completions", json={**body, "prompt": ["hello"] * 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "5 sequences" in r.text, r.text
        r = post(f"{server.url}/v1/chat/completions", json={**body, "n": 5,
                                                           "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert "more than the server holds at once (4)" in r.text
        assert post(f"{server.url}/v1/completions", json={**body, "prompt": ["hello"] * 2, "n": 2}).status_code == 200

        async def two_of_three_sequences():
            async with httpx.AsyncClient(timeout=300) as client:
                long = {**body, "max_tokens": 200, "prompt": ["hello"] * 3}
                return await asyncio.gather(*[client.post(f"{server.url}/v1/completions", json=long)
                                              for _ in range(2)])

        statuses = sorted(r.status_code for r in asyncio.run(two_of_three_sequences()))
        assert statuses == [200, 429], statuses  # 3 + 3 sequences do not fit in 4
        assert app.state.alchemist.engine.engine.num_requests == 0


def test_bodies_that_never_end_hold_no_capacity():
    """Capacity used to be charged before the body was read: a few connections sending half
    a body, then nothing, locked every client out with 429 for as long as they stayed (a
    fuzzing pass held 262)."""
    import socket

    app = tiny_app(max_num_seqs=1, server=ServerConfig(max_queued_requests=1))
    with ServerThread(app) as server:
        host, port = server.url.removeprefix("http://").split(":")
        stalled = []
        try:
            for _ in range(4):  # twice the capacity
                sock = socket.create_connection((host, int(port)))
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny")
                stalled.append(sock)
            time.sleep(0.5)
            r = post(f"{server.url}/v1/chat/completions", json={
                "model": TINY_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
        finally:
            for sock in stalled:
                sock.close()


def test_a_full_server_refuses_a_generation_before_reading_its_body():
    """An outside pass (guidellm's sweep retrying 429s at once, 490 a second): each refusal
    went through the whole app (its body read and parsed). While every sequence is held,
    a generation's 429 comes from its headers alone, as cheap as a health probe."""
    import socket

    from server.guards import RequestGuard

    app = tiny_app(max_num_seqs=1, server=ServerConfig(max_queued_requests=0))
    with ServerThread(app) as server:
        guard = app.middleware_stack
        while not isinstance(guard, RequestGuard):
            guard = guard.app
        guard.in_flight = guard.config.max_in_flight  # as if a request held the one sequence
        host, port = server.url.removeprefix("http://").split(":")
        for path in (b"/v1/chat/completions", b"/v1/completions", b"/v1/responses"):
            with socket.create_connection((host, int(port)), timeout=60) as sock:
                sock.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny")  # the rest never comes
                head = sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in head.lower(), (path, head)
            assert b"rate_limit_exceeded" in head
        assert get(f"{server.url}/v1/models").status_code == 200  # only generations wait for room
        guard.in_flight = 0
        r = post(f"{server.url}/v1/chat/completions", json={
            "model": TINY_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text  # the refusal held nothing
        assert guard.in_flight == 0


def test_web_pages_of_the_allowed_origins_alone_may_call_the_server():
    """CORS is opt-in (`--allowed-origins`): by default no page the user opens can post a
    JSON label or rollback to a local server (its preflight finds no CORS headers); an
    allowed origin's preflight passes before the key is asked for, and its requests still
    need the key."""
    from fastapi.testclient import TestClient

    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with TestClient(tiny_app()) as client:
        r = client.options("/v1/feedback", headers=preflight)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    with TestClient(tiny_app(server=ServerConfig(api_key="k", allowed_origins=("https://app.example",)))) as client:
        r = client.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert client.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}
                              ).status_code == 400
        body = {"model": TINY_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
        r = client.post("/v1/chat/completions", json=body, headers={"Origin": "https://app.example"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = client.post("/v1/chat/completions", json=body, headers={"Origin": "https://app.example",
                                                                    "Authorization": "Bearer k"})
        assert r.status_code == 200 and "x-request-id" in r.headers["access-control-expose-headers"].lower()
