"""The server's front door: authentication, body size, admission, response counting.

A plain ASGI middleware (not Starlette's `BaseHTTPMiddleware`, which would buffer SSE
streams and hide client disconnects from the routes). For every HTTP request it:
  - requires `Authorization: Bearer <key>` on `/v1/*` when a key is configured (the
    adapter routes take the admin key when one is set); `/health` and `/metrics` stay
    open for probes and Prometheus. 401 otherwise.
  - rejects bodies over `max_body_bytes` with 413: up front from Content-Length, and
    while reading for chunked bodies.
  - admits at most `max_num_seqs + max_queued_requests` generation requests at once;
    beyond that a new one gets 429 with `Retry-After` at once, never a hang or a 5xx.
  - counts responses by route and status (`alchemist:http_requests_total`): the client's
    only, not a replica's question to another on its behalf (server/fanout.py's header,
    on the private port replicas ask on), which would count one request twice in a sum
    over the replicas.
  - answers every response with an `x-request-id` header, as OpenAI does (the SDK's
    `.request_id`): the client's own `X-Request-Id` when it sent a usable one (vLLM's
    echo), else a fresh `req_…`.
Refusals carry OpenAI's error body, so the SDK raises AuthenticationError,
RateLimitError, and so on.
"""

from __future__ import annotations

import hmac
import json
import logging
import uuid
from dataclasses import dataclass

from starlette.requests import ClientDisconnect

from server.errors import APIError, error_body
from server.fanout import LOCAL_HEADER
from server.route_table import OPERATIONS, route_of

# the routes that generate (the table's streaming ones): each holds capacity for its sequences
GENERATION_ROUTES = frozenset(path for (method, path), operation in OPERATIONS.items()
                              if method == "post" and operation.streams)
ADMIN_PREFIX = "/v1/adapters"
logger = logging.getLogger(__name__)
# where a generation route finds how to hold the sequences its body asks for (`admit_sequences`)
ADMIT_KEY = "alchemist.admit"


def admit_sequences(request, sequences: int, param: str = "n") -> None:
    """Holds `sequences` of the server's capacity for this request (raises APIError 429, or
    400 naming `param`, what asked for too many)."""
    admit = request.scope.get("state", {}).get(ADMIT_KEY)
    if admit is not None:
        admit(sequences, param)


# the longest client X-Request-Id echoed back (a longer one gets a new id)
MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True)
class GuardConfig:
    api_key: str = ""
    admin_key: str = ""
    # generation sequences in flight at once (running + queued: a request's prompts × n); more get 429
    max_in_flight: int = 1 << 30
    max_body_bytes: int = 4 << 20
    # the private port a replica is asked on by the others (server/fanout.py): their
    # questions, which carry its header there, are not counted as requests
    replica_port: int | None = None
    # origins whose pages may call the server from a browser (CORS; none: no CORS headers)
    allowed_origins: tuple[str, ...] = ()

    def key_for(self, path: str) -> str:
        """The key a request to `path` must carry ("" for none): the admin key on the adapter
        routes where one is set, else the API key, on `/v1/*` only."""
        if not path.startswith("/v1/"):
            return ""
        return self.admin_key if path.startswith(ADMIN_PREFIX) and self.admin_key else self.api_key


class RequestGuard:
    def __init__(self, app, config: GuardConfig, count_response=None):
        self.app = app
        self.config = config
        # called with (route label, status code) for every response
        self.count_response = count_response or (lambda route, status: None)
        self.in_flight = 0

    def _charge(self, charged: list[int], sequences: int, param: str = "n") -> None:
        """Holds `sequences` of the capacity for a request (once its body says how many: its
        prompts × n), or refuses it: 429 while others hold the room, 400 if it never fits."""
        limit = self.config.max_in_flight
        if sequences > limit:
            raise APIError(400, f"This request asks for {sequences} sequences (prompts × n), more than the server "
                                f"holds at once ({limit}).", param, "invalid_value")
        extra = sequences - charged[0]
        if extra > 0 and self.in_flight + extra > limit:
            raise self._at_capacity()
        self.in_flight += max(extra, 0)
        charged[0] += max(extra, 0)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = route_of(path) or "other"
        status_seen = []
        request_id = _request_id(scope)
        port = (scope.get("server") or (None, None))[1]
        asked_by_replica = (self.config.replica_port is not None and port == self.config.replica_port
                            and _header(scope, LOCAL_HEADER.encode()) == "1")

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id)]
            await send(message)

        try:
            refusal = self._refusal(scope, path) or self._full(scope, path)
            if refusal is not None:
                return await _send_error(counting_send, refusal)
            charged = [0]  # the sequences this request holds of max_in_flight
            if path in GENERATION_ROUTES:  # charged once its body is read: a body that never ends holds nothing
                scope.setdefault("state", {})[ADMIT_KEY] = lambda count, param: self._charge(charged, count, param)
            try:
                await self.app(scope, self._limited(receive), counting_send)
            except ClientDisconnect:  # gone while its body was read: nothing to answer, counted as 499 below
                pass
            except Exception as exc:  # past the app's handlers: answered here, with the request id
                if status_seen:
                    raise  # a response began: nothing can be sent any more
                logger.exception("unhandled error")
                await _send_error(counting_send, APIError(500, f"internal error: {type(exc).__name__}",
                                                          type="server_error"))
            finally:
                self.in_flight -= charged[0]
        finally:
            if not asked_by_replica:
                self.count_response(route, status_seen[0] if status_seen else 499)

    def _refusal(self, scope, path: str) -> APIError | None:
        key = self.config.key_for(path)
        if key:
            given = _bearer(scope)
            if given is None:
                return APIError(401, "You didn't provide an API key. Send it in the Authorization header "
                                     "as 'Authorization: Bearer YOUR_KEY'.", code="missing_api_key",
                                type="invalid_request_error")
            if not hmac.compare_digest(given.encode(), key.encode()):
                which = "admin key" if key is self.config.admin_key else "API key"
                return APIError(401, f"Incorrect {which} provided.", code="invalid_api_key",
                                type="invalid_request_error")
        length = _header(scope, b"content-length")
        if length is not None:
            if not length.isdigit():
                return APIError(400, "The Content-Length header is not a number.", code="invalid_request")
            if int(length) > self.config.max_body_bytes:
                return self._too_large()
        return None

    def _full(self, scope, path: str) -> APIError | None:
        """A generation request while every sequence of the capacity is held: refused
        before its body is read (a client retrying 429s at once costs the server least)."""
        if scope.get("method") == "POST" and path in GENERATION_ROUTES and self.in_flight >= self.config.max_in_flight:
            return self._at_capacity()
        return None

    def _at_capacity(self) -> APIError:
        return APIError(429, f"The server is at capacity ({self.config.max_in_flight} sequences running or queued); "
                             "retry shortly.", code="rate_limit_exceeded", headers={"retry-after": "1"})

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than the server's limit of "
                             f"{self.config.max_body_bytes} bytes.", code="request_too_large")

    def _limited(self, receive):
        limit, seen = self.config.max_body_bytes, 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # the app's error handlers turn this into the 413 response
                    raise self._too_large()
            return message

        return limited_receive


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


def _request_id(scope) -> bytes:
    """The client's X-Request-Id if it is short printable ASCII (it goes back in a header),
    else a new one."""
    given = _header(scope, b"x-request-id")
    if given and len(given) <= MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable():
        return given.encode()
    return f"req_{uuid.uuid4().hex}".encode()


def _bearer(scope) -> str | None:
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def _send_error(send, err: APIError) -> None:
    body = json.dumps(error_body(err.status, err.message, err.param, err.code, err.type), ensure_ascii=False,
                      separators=(",", ":")).encode()  # as every other error body (JSONResponse)
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        raw_headers.append((b"www-authenticate", b"Bearer"))
    raw_headers += [(k.encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
