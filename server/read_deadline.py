"""uvicorn's HTTP protocol with read deadlines, and the uvicorn configuration that uses it.

uvicorn closes a kept-alive connection that stays idle after a response, but never one that
has not sent a whole request: a client that connects and sends nothing, or trickles its
headers a byte at a time, or vanished mid-request behind a NAT, holds a connection (and a
file descriptor) for as long as the process lives. Here, as nginx's `client_header_timeout`
and `client_body_timeout` do:
  - a request's headers must arrive within `read_timeout_s` of the connection's opening or
    of the request's first byte; a request begun and not finished gets a 408, one never
    begun is closed silently (as uvicorn closes an idle kept-alive connection);
  - its body may pause no longer than `read_timeout_s` between pieces while the server is
    reading it (not while the app has not yet taken what arrived), and past its first
    `read_timeout_s` must arrive at `MIN_BODY_RATE` on average (Apache's `MinRate`); else it
    gets a 408 too, unless its answer has begun.
Connections with a whole request in hand are never timed: a long answer streams as long as
it takes. When the server shuts down, a request whose body is still arriving is answered 503
at once (uvicorn would wait its whole grace period for the rest, then cancel the app: a 500).
"""

from __future__ import annotations

import asyncio

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from server.config import ServerConfig
from server.errors import error_body


# past its first `read_timeout_s`, a body must keep up this average (bytes per second), as
# Apache's mod_reqtimeout asks by default: a trickle of a byte now and then cannot hold a
# connection however short its pauses
MIN_BODY_RATE = 500
# the ASGI scope's extension through which the app may drop its connection at once (a stream
# whose client reads nothing: server/streams.py), where a close would wait to flush
ABORT_CONNECTION = "alchemist.abort_connection"


class ReadDeadlineProtocol(HttpToolsProtocol):
    """HttpToolsProtocol whose reads of a request have deadlines; `read_timeout_s` is set
    on the subclass `protocol_with_read_timeout` makes."""

    read_timeout_s: float = ServerConfig.read_timeout_s

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._read_deadline: asyncio.TimerHandle | None = None
        self._request_begun = self._reading_body = False
        self._body_started, self._body_bytes = 0.0, 0
        super().connection_made(transport)
        self._arm(self._headers_late)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # bytes that begin no request (blank lines between requests) cancelled uvicorn's keep-alive
        # timer: without a deadline of ours, nothing would close the connection
        if (self._read_deadline is None and self.timeout_keep_alive_task is None and not self._answering()
                and not self.transport.is_closing()):
            self._arm(self._headers_late)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._request_begun = True
        if self._read_deadline is None:  # the connection's own deadline runs on, not restarted by a first byte
            self._arm(self._headers_late)

    def on_headers_complete(self) -> None:
        self._reading_body = True
        self._body_started, self._body_bytes = self.loop.time(), 0
        self.scope.setdefault("extensions", {})[ABORT_CONNECTION] = self.transport.abort
        self._arm(self._body_late)  # lifted when the message completes (at once without a body)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        # the next piece within the gap, and the whole at MIN_BODY_RATE past the first gap
        by_rate = self._body_started + self.read_timeout_s + self._body_bytes / MIN_BODY_RATE - self.loop.time()
        self._arm(self._body_late, max(0.0, min(self.read_timeout_s, by_rate)))
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        self._request_begun = self._reading_body = False
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # a request read while this answer ran waited on the server (pipelined): its clock starts now
        if self._request_begun and not self.transport.is_closing():
            if self._reading_body:
                self._body_started, self._body_bytes = self.loop.time(), 0
            self._arm(self._body_late if self._reading_body else self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _answering(self) -> bool:
        """A request of this connection is being answered, or waits to be (pipelined)."""
        return (self.cycle is not None and not self.cycle.response_complete) or bool(self.pipeline)

    def _queued(self) -> bool:
        """The request being read waits behind another's answer."""
        return any(cycle is self.cycle for cycle, _ in self.pipeline)

    def _arm(self, on_expiry, delay: float | None = None) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.read_timeout_s if delay is None else delay, on_expiry)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _headers_late(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused or self._answering():  # the wait is the server's: uvicorn reads the next request later
            self._arm(self._headers_late)
            return
        if self._request_begun:
            self.transport.write(error_response(408, f"the request's headers did not arrive within "
                                                     f"{self.read_timeout_s:g} s", "request_timeout"))
        self.transport.close()

    def _body_late(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        # the wait is the server's: the app has not taken what arrived, has not asked for the body yet, or
        # the request waits behind another's answer (pipelined: uvicorn reads on once that ends)
        if self.flow.read_paused or self._queued() or (self.cycle is not None and self.cycle.waiting_for_100_continue):
            self._body_started, self._body_bytes = self.loop.time(), 0  # the rate counts from when reading resumes
            self._arm(self._body_late)
            return
        self._answer_instead_of_the_app(error_response(408, f"the request's body did not arrive at "
                                                            f"{MIN_BODY_RATE} bytes a second, or paused for "
                                                            f"{self.read_timeout_s:g} s", "request_timeout"))

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown (closes idle connections, lets answers begun finish)."""
        if (self._reading_body and self.cycle is not None and not self.cycle.response_started and not self._queued()
                and not self.transport.is_closing()):
            self._disarm()
            self._answer_instead_of_the_app(error_response(
                503, "the server is shutting down: the request's body had not arrived whole; send the request again",
                "server_shutting_down"))
            return
        super().shutdown()

    def _answer_instead_of_the_app(self, response: bytes) -> None:
        """Ends a request whose body is being read: `response`, unless the app's answer has
        begun, then the connection closes. The app reading the body hears that its client
        left (uvicorn's disconnect) at once, so that nothing it sends follows `response`."""
        cycle = self.cycle
        if not cycle.response_started:
            self.transport.write(response)
        self.transport.close()
        cycle.disconnected = True
        cycle.message_event.set()


def error_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP response with an error body in OpenAI's format; the connection then closes."""
    body = orjson.dumps(error_body(status, message, code=code))
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body])


def protocol_with_read_timeout(read_timeout_s: float) -> type[ReadDeadlineProtocol]:
    """ReadDeadlineProtocol with its deadline set (uvicorn builds one protocol per connection from a class)."""
    return type("ReadDeadlineProtocol", (ReadDeadlineProtocol,), {"read_timeout_s": float(read_timeout_s)})


def uvicorn_config(app, server: ServerConfig, **kwargs) -> uvicorn.Config:
    """uvicorn's configuration for `app`: the read deadlines of `server`, the rest from `kwargs`."""
    return uvicorn.Config(app, http=protocol_with_read_timeout(server.read_timeout_s), **kwargs)
