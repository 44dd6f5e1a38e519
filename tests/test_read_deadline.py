"""Read deadlines on HTTP connections (server/read_deadline.py): a connection that sends no
whole request is closed, one whose request arrived whole is never timed."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time

import pytest

from server.config import ServerConfig
from tests.servers import ServerThread

# long beside what a loaded machine's event loop may stall for (a timer runs late, not early)
DEADLINE_S = 1.5


async def slow_echo(scope, receive, send):
    """A raw ASGI app: reads the whole body, waits past the deadline, answers the body's length."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": message["type"] + ".complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    await asyncio.sleep(2 * DEADLINE_S)
    body = str(size).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def server():
    with ServerThread(slow_echo, ServerConfig(read_timeout_s=DEADLINE_S)) as running:
        yield running


def connect(server) -> socket.socket:
    client = socket.create_connection(("127.0.0.1", server.port))
    client.settimeout(30)
    return client


def trickle_until_closed(client: socket.socket, data: bytes, gap_s: float) -> float | None:
    """Sends `data` a byte at a time, `gap_s` apart, until the server answers or closes;
    when that was (monotonic), or None if it never did."""
    for index in range(len(data)):
        try:
            client.send(data[index:index + 1])
        except OSError:
            return time.monotonic()
        if select.select([client], [], [], gap_s)[0]:  # an answer, or the close
            return time.monotonic()
    return None


def read_all(client: socket.socket) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and when it closed (monotonic)."""
    chunks = []
    while chunk := client.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks), time.monotonic()


def test_a_connection_that_sends_nothing_is_closed_without_a_word(server):
    client = connect(server)
    started = time.monotonic()
    data, closed = read_all(client)
    assert data == b""
    assert DEADLINE_S * 0.5 <= closed - started < 10


def test_a_body_that_stops_arriving_gets_a_408_in_openais_format(server):
    """As the README says of a request whose headers had begun (it was closed without a word)."""
    client = connect(server)
    client.sendall(b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 100\r\n\r\n" + b"b" * 10)
    started = time.monotonic()
    data, closed = read_all(client)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), data
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "body" in error["message"]
    assert DEADLINE_S * 0.5 <= closed - started < 10


def test_a_body_still_arriving_when_the_server_shuts_down_gets_a_503_at_once():
    """uvicorn lets answers finish; the app waiting for the rest of a body would wait until
    its grace ran out (the server's: 10 s, then a 500; here none: for ever)."""
    reading = threading.Event()

    async def reads_the_body(scope, receive, send):
        if scope["type"] == "lifespan":
            return await slow_echo(scope, receive, send)
        while (message := await receive())["type"] == "http.request":
            reading.set()
            if not message.get("more_body"):
                return await send({"type": "http.response.start", "status": 200, "headers": []})

    with ServerThread(reads_the_body, ServerConfig(read_timeout_s=60)) as running:
        client = connect(running)
        client.sendall(b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 100\r\n\r\n" + b"b" * 10)
        assert reading.wait(30)
        started = time.monotonic()
        running.server.should_exit = True
        data, _ = read_all(client)
        running.thread.join(30)
        assert not running.thread.is_alive() and time.monotonic() - started < 10
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), data
    assert json.loads(body)["error"]["code"] == "server_shutting_down"


def test_headers_begun_and_not_finished_get_a_408_in_openais_format(server):
    client = connect(server)
    client.sendall(b"POST /x HTTP/1.1\r\nhost: a\r\nx-unfinished: ")
    data, _ = read_all(client)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    assert "headers" in error["message"]


def test_headers_trickled_a_byte_at_a_time_do_not_restart_the_clock(server):
    client = connect(server)
    opened = time.monotonic()
    # 200 bytes a sixth of the deadline apart: 30 deadlines if it never closed
    closed = trickle_until_closed(client, b"POST /x HTTP/1.1\r\nhost: a\r\nx-padding: " + b"a" * 200, DEADLINE_S / 6)
    assert closed is not None and closed - opened < 10  # (a trickle never cut would take 50 s)


def test_a_body_sent_in_pieces_within_the_gap_is_read_whole_however_long_it_takes(server):
    client = connect(server)
    client.sendall(b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 8000\r\nconnection: close\r\n\r\n")
    for _ in range(8):  # 8 pauses of a third of the deadline (the whole takes longer than it), at 2 kB/s
        time.sleep(DEADLINE_S / 3)
        client.sendall(b"c" * 1000)
    data, _ = read_all(client)
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"\r\n\r\n8000")


def test_a_body_trickled_below_the_minimum_rate_is_cut(server):
    """Each pause within the gap, the whole far below MIN_BODY_RATE: the connection does
    not outlive the first gap by much."""
    client = connect(server)
    client.sendall(b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 1000\r\n\r\n")
    started = time.monotonic()
    closed = trickle_until_closed(client, b"d" * 1000, DEADLINE_S / 4)
    assert closed is not None and closed - started < 10  # (never cut: 375 s)


def test_blank_lines_after_an_answer_do_not_keep_the_connection(server):
    """uvicorn's keep-alive timer is cancelled by any bytes; blank lines begin no request."""
    client = connect(server)
    client.sendall(b"GET /x HTTP/1.1\r\nhost: a\r\n\r\n")
    response = b""
    while not response.endswith(b"\r\n\r\n0"):
        assert (chunk := client.recv(65536)), response
        response += chunk
    client.sendall(b"\r\n")
    data, _ = read_all(client)  # closed (uvicorn's keep-alive is 5 s: the socket's own timeout is 30)
    assert data == b""


def test_a_pipelined_request_waits_for_the_answers_before_it_without_a_408_among_them(server):
    """While earlier requests are answered, uvicorn reads no further: the next one's
    headers waiting then is the server's doing; its deadline runs once they are answered."""
    client = connect(server)
    client.sendall(b"GET /x HTTP/1.1\r\nhost: a\r\n\r\n" b"GET /y HTTP/1.1\r\nhost: a\r\n\r\n"
                   b"GET /z HTTP/1.1\r\nhost:")
    data, _ = read_all(client)
    answers = data.split(b"HTTP/1.1 ")[1:]
    assert [answer[:3] for answer in answers] == [b"200", b"200", b"408"], data
    assert answers[0].endswith(b"\r\n\r\n0") and answers[1].endswith(b"\r\n\r\n0")


def test_an_answer_longer_than_the_deadline_and_the_next_request_on_the_connection(server):
    client = connect(server)
    for _ in range(2):  # the second on the kept-alive connection: its deadline starts at its first byte
        client.sendall(b"GET /x HTTP/1.1\r\nhost: a\r\n\r\n")
        response = b""
        while not response.endswith(b"\r\n\r\n0"):
            assert (chunk := client.recv(65536)), response
            response += chunk
        assert response.startswith(b"HTTP/1.1 200") and response.endswith(b"\r\n\r\n0")
        time.sleep(DEADLINE_S / 2)
    client.close()


def test_a_pipelined_body_is_timed_from_when_the_server_reads_it(server):
    """A body waiting behind an earlier answer (uvicorn reads no further meanwhile) is not
    behind its rate when reading resumes."""
    client = connect(server)
    client.sendall(b"GET /x HTTP/1.1\r\nhost: a\r\n\r\n"
                   b"POST /y HTTP/1.1\r\nhost: a\r\ncontent-length: 400\r\nconnection: close\r\n\r\n" + b"e" * 100)
    response = b""
    while b"\r\n\r\n0" not in response:  # the first answer, after 2 deadlines
        assert (chunk := client.recv(65536)), response
        response += chunk
    for _ in range(3):  # the rest at 1 kB/s
        time.sleep(0.1)
        client.sendall(b"e" * 100)
    data, _ = read_all(client)
    assert (response + data).split(b"HTTP/1.1 ")[2].startswith(b"200") and data.endswith(b"\r\n\r\n400"), data


def test_the_read_timeout_must_be_positive():
    for bad in (0, -1.0, float("inf"), True, "30"):
        with pytest.raises(ValueError, match="server.read_timeout_s"):
            ServerConfig(read_timeout_s=bad)
    assert ServerConfig(read_timeout_s=5).read_timeout_s == 5
