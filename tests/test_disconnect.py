"""A client that goes away stops its request at once (real HTTP, tiny model): long before
it would have finished, counted in generated tokens, not in seconds (CI machines are slow)."""

import dataclasses
import json
import socket
import threading

import httpx
import pytest
from sse_starlette.sse import AppStatus

from server import streams
from tests.servers import PATIENCE_S, TINY_NAME, ServerThread, tiny_app, wait_for
from tests.test_feedback import metric

LONG = {"model": TINY_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3000,
        "ignore_eos": True}


def engine_of(app):
    return app.state.alchemist.engine


def generated_tokens(server) -> float:
    with httpx.Client(base_url=server.url, timeout=300) as client:
        return metric(client, "alchemist:generation_tokens_total")


class StepGate:
    """An engine observer that holds the device thread in the step after the first text
    (before that step's outputs go out) until released: the request cannot finish, or
    run on, while the client reads that text and leaves, however slow the machine is."""

    def __init__(self):
        self.text = threading.Event()
        self.release = threading.Event()
        self.finished: list[tuple[list, object]] = []  # (finish reasons, error) of finished outputs

    def on_step(self, stats) -> None:
        if self.text.is_set():
            self.release.wait(PATIENCE_S)

    def on_output(self, output) -> None:
        if any(choice.text for choice in output.outputs):
            self.text.set()
        if output.finished:
            self.finished.append(([choice.finish_reason for choice in output.outputs], output.error))


def first_content(response) -> list[str]:
    """The stream's lines up to the first with text in its delta."""
    lines = []
    for line in response.iter_lines():
        lines.append(line)
        if line.startswith("data: {"):
            if any(choice["delta"].get("content") for choice in json.loads(line[len("data: "):])["choices"]):
                break
    return lines


def test_streaming_client_disconnect_aborts_the_request():
    app = tiny_app(max_model_len=4096, kv_cache_bytes=16 << 20)
    engine = engine_of(app)
    gate = StepGate()
    engine.engine.hooks = dataclasses.replace(engine.engine.hooks, observers=(*engine.engine.hooks.observers, gate))
    with ServerThread(app) as server:
        try:
            with httpx.Client(base_url=server.url, timeout=300) as client:
                with client.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
                    lines = first_content(r)
                    # still running when the client leaves; if not, why it ended and what the stream said
                    assert engine.engine.num_requests == 1 and not gate.finished, (gate.finished, lines[-4:])
            wait_for(engine.interrupted)  # the disconnect's abort is queued for the next step boundary
        finally:
            gate.release.set()
        wait_for(lambda: engine.engine.num_requests == 0)
        assert gate.finished == [(["abort"], None)]
        assert generated_tokens(server) < 2900  # stopped long before max_tokens


def test_non_streaming_client_disconnect_aborts_the_request():
    app = tiny_app(max_model_len=4096, kv_cache_bytes=16 << 20)
    engine = engine_of(app)
    with ServerThread(app) as server:
        body = httpx.Request("POST", f"{server.url}/v1/chat/completions", json=LONG).read()
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: engine.engine.num_requests == 1)
        sock.close()
        wait_for(lambda: engine.engine.num_requests == 0)
        assert generated_tokens(server) < 2900  # stopped long before max_tokens


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", LONG),
    ("/v1/completions", {"model": TINY_NAME, "prompt": "Hello", "max_tokens": 3000, "ignore_eos": True}),
])
def test_a_stream_running_into_a_shutdown_ends_as_an_abort_rather_than_cut(monkeypatch, path, body):
    """SIGTERM with a stream running past the drain cut it without a finish reason or
    [DONE] (an outside pass): its request is now stopped shortly before the cut, and an
    error event tells the client the answer was cut short (the SDK raises it); no chunk
    gives a finish reason."""
    monkeypatch.setattr(streams, "STREAM_DRAIN_S", 30.5)  # the cut: far beyond the abort
    monkeypatch.setattr(streams, "ABORT_BEFORE_CUT_S", 30.0)  # the abort: 0.5 s after the signal
    app = tiny_app(max_model_len=4096, kv_cache_bytes=16 << 20)
    with ServerThread(app) as server:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            with client.stream("POST", path, json={**body, "stream": True}) as r:
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                    if len(events) == 5:
                        monkeypatch.setattr(AppStatus, "should_exit", True)  # what uvicorn's SIGTERM sets
        monkeypatch.setattr(AppStatus, "should_exit", False)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down"
        assert json.loads(events[-2])["error"]["type"] == "service_unavailable"  # as the whole answer's 503
        reasons = [choice["finish_reason"] for event in events[:-2] for choice in json.loads(event)["choices"]]
        # no finish reason: "stop" (OpenAI has no "abort") passed the cut answer off as complete
        assert set(reasons) == {None} and generated_tokens(server) < 2900


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", LONG),
    ("/v1/completions", {"model": TINY_NAME, "prompt": "Hello", "max_tokens": 3000, "ignore_eos": True}),
])
def test_a_whole_answer_running_into_a_shutdown_gets_a_503_in_openais_format(monkeypatch, path, body):
    """SIGTERM with a request answered whole (not streamed) running past the drain: uvicorn
    cancelled it when its graceful shutdown ran out and sent a plain-text 500 (an outside
    pass). It is now stopped when a stream would be, and answered 503 with OpenAI's error
    body (`server_shutting_down`), which the SDK raises as a retryable error."""
    monkeypatch.setattr(streams, "STREAM_DRAIN_S", 30.5)
    monkeypatch.setattr(streams, "ABORT_BEFORE_CUT_S", 30.0)  # the cut: 0.5 s after the signal
    app = tiny_app(max_model_len=4096, kv_cache_bytes=16 << 20)
    engine = engine_of(app)
    with ServerThread(app) as server:
        answers = []
        asking = threading.Thread(target=lambda: answers.append(httpx.post(server.url + path, json=body,
                                                                           timeout=300)))
        asking.start()
        wait_for(lambda: engine.engine.num_requests == 1)
        monkeypatch.setattr(AppStatus, "should_exit", True)  # what uvicorn's SIGTERM sets
        asking.join(PATIENCE_S)
        monkeypatch.setattr(AppStatus, "should_exit", False)
        wait_for(lambda: engine.engine.num_requests == 0)  # its engine request was aborted
        assert answers[0].status_code == 503, answers[0].text
        assert answers[0].json()["error"]["code"] == "server_shutting_down"
        assert answers[0].json()["error"]["type"] == "service_unavailable"
        assert "this answer was cut short" in answers[0].json()["error"]["message"]
        assert generated_tokens(server) < 2900
        # one that comes after the shutdown began (a kept-alive connection) is told so, not "cut short"
        monkeypatch.setattr(AppStatus, "should_exit", True)
        late = httpx.post(server.url + path, json=body, timeout=300)
        monkeypatch.setattr(AppStatus, "should_exit", False)
        assert late.status_code == 503 and "came after the shutdown began" in late.json()["error"]["message"]


@pytest.mark.parametrize("finish_reason, cut", [("stop", False), ("length", False), ("abort", True)])
def test_only_an_answer_the_shutdown_aborted_ends_with_the_error_event(finish_reason, cut):
    """The error event follows from an aborted choice, not from when the shutdown's abort
    fired: a stream whose choices all finished on their own just before it ends as usual
    (it got the error event too, when its [DONE] was sent after the abort)."""
    import asyncio

    from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from server.token_shown import TokenShown

    async def outputs():
        metrics = RequestMetrics(arrival_time=0.0, first_token_time=0.0, finish_time=0.0, num_prompt_tokens=3,
                                 num_generation_tokens=2)
        for finished in (False, True):
            choice = CompletionOutput(index=0, text="Hi", token_ids=[7], logprobs=None,
                                      finish_reason=finish_reason if finished else None)
            yield RequestOutput("chatcmpl-1", [choice], finished, metrics)

    async def chat():
        return [event async for event in streams.chat_events("chatcmpl-1", TINY_NAME, outputs(), 1, 3, None,
                                                              TokenShown(None))]

    async def completion():
        return [event async for event in streams.completion_events("cmpl-1", TINY_NAME, [outputs()], [([1, 2, 3], "")],
                                                                    1, False, None, None, TokenShown(None))]

    for events in (asyncio.run(chat()), asyncio.run(completion())):
        assert events[-1] == streams.DONE
        payloads = [json.loads(e.decode()[len("data: "):]) for e in events[:-1]]
        errors = [p for p in payloads if "error" in p]
        assert [e["error"]["code"] for e in errors] == (["server_shutting_down"] if cut else [])
        reasons = [c["finish_reason"] for p in payloads if "choices" in p for c in p["choices"]]
        assert reasons[-1] == (None if cut else finish_reason)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/feedback"])
def test_a_client_gone_while_its_body_was_read_is_a_499_not_a_500(path, caplog):
    """It sent a part of what Content-Length promised and left: nothing is answered, no
    error is logged, and the metrics say 499 (a 5xx alert would fire on a timeout)."""
    with ServerThread(tiny_app()) as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        "Content-Length: 1000\r\n\r\n{\"model\": \"ti".encode())
        with httpx.Client(base_url=server.url, timeout=30) as client:
            series = f'alchemist:http_requests_total{{handler="{path}",status="499"}}'
            wait_for(lambda: metric(client, series) >= 1)
            assert metric(client, f'alchemist:http_requests_total{{handler="{path}",status="500"}}') == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_handler_cancelled_while_it_waits_cancels_its_work_and_watchers():
    """uvicorn cancels a handler its graceful shutdown could not wait for: the work (and
    so its engine requests) and the watchers beside it end with it (a review: they ran on)."""
    import asyncio

    class Silent:  # a client that neither sends nor leaves
        async def receive(self):
            await asyncio.Event().wait()

    async def run():
        work_cancelled = asyncio.Event()

        async def work():
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                work_cancelled.set()
                raise

        handler = asyncio.ensure_future(streams.until_disconnect(Silent(), work()))
        await asyncio.sleep(0.1)
        before = asyncio.all_tasks()
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler
        for _ in range(5):  # the cancellations land in the loop's next iterations
            await asyncio.sleep(0)
        assert work_cancelled.is_set()
        return [task for task in before if not task.done() and task is not asyncio.current_task()]

    assert asyncio.run(run()) == []


@pytest.mark.parametrize("last", [False, True], ids=["events-go-on", "the-last-event-fills-the-buffers"])
def test_a_client_that_stops_reading_its_stream_lets_it_go(monkeypatch, last):
    """A client that keeps its connection but reads nothing held its stream (and its
    request's place) for as long as it stayed: once the sockets' buffers are full, a stream
    whose sends wait past STREAM_SEND_TIMEOUT_S ends, its events closed as a disconnect's,
    and its connection is dropped (a close would wait to flush what the client never reads),
    also where the closing send is the one that waits (sse-starlette bounds only events)."""
    import socket
    import threading

    from fastapi import FastAPI

    from server import streams
    from tests.servers import ServerThread, wait_for

    monkeypatch.setattr(streams, "STREAM_SEND_TIMEOUT_S", 1.0)
    ended = threading.Event()

    async def events():
        try:
            while True:
                yield b"data: " + b"x" * (4 << 20) + b"\n\n"
                if last:
                    return
        finally:
            ended.set()  # (an answer's events close its engine stream, which aborts its request)

    class Engine:  # what the response asks of the engine: to abort its requests at a shutdown's cut
        def abort(self, request_id: str) -> None:
            raise AssertionError("no shutdown here")

    app = FastAPI()
    app.add_api_route("/stream", lambda: streams.event_stream_response(events(), Engine(), ["r"]))
    with ServerThread(app) as server:
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", server.port))
            client.sendall(b"GET /stream HTTP/1.1\r\nhost: a\r\n\r\n")
            assert ended.wait(120)
            wait_for(lambda: not server.server.server_state.connections and not server.server.server_state.tasks)
