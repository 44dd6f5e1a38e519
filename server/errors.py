"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Every path out of the server that is not a success goes through here — validation
errors (pydantic's, and the engine's `InvalidParameter`) become 400 (never FastAPI's
422), unknown routes 404, and an unexpected exception a 500 whose body still has
OpenAI's shape.
"""

from __future__ import annotations

import json
import logging
import typing

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from pydantic_core.core_schema import ErrorType
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.sampling_params import InvalidParameter
from server.protocol import NOT_OFFERED
from server.protocol_responses import NOT_OFFERED as NOT_OFFERED_IN_RESPONSES
from server.route_table import PLAIN_PATHS

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None) -> dict:
    err = APIError(status, message, param, code, type)
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code, err.type), status_code=err.status,
                        headers=err.headers)


def shown(value: str, limit: int = 100) -> str:
    """A client's string as an error message quotes it: its beginning, where it is long (a
    60,000-character id is not echoed back whole)."""
    return value if len(value) <= limit else value[:limit] + "…"


def _loc_to_param(loc: tuple) -> str:
    if loc[:1] in (("query",), ("path",)):  # a URL's parameter (FastAPI's validation), named as sent
        loc = loc[1:]
    parts = [str(p) for p in loc if p not in ("body",)]
    # pydantic appends the union member it tried ("str", "list[TextPart]"); drop those
    # and a union's model by its class name ("NamedToolChoice"): fields are snake_case
    parts = [p for p in parts if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool")
             and not p[:1].isupper()]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


# pydantic's own error types (a validator of this server's raises others, with messages of their own)
_PYDANTIC_ERRORS = frozenset(typing.get_args(ErrorType))
# what a type error's member expected, as JSON kinds (bool is not a number to a schema)
_EXPECTED_KINDS = {"string_type": (str,), "int_type": (int, float), "float_type": (int, float), "list_type": (list,),
                   "dict_type": (dict,), "bool_type": (bool,)}


def _best_match(errors: list[dict], tagged: bool = False) -> dict:
    """The first error's field, as the member of a union that got furthest explains it: the
    deepest location, a value's constraint before a type mismatch (`[[-1]]` as a prompt is
    a negative token id, not a list that should have been a string), the furthest item of
    a list (`["a", 1]`: its item 1 should be a string), then the member that expected the
    value's kind (`[1.5]`: a token id should be an integer). `tagged`: the location starts
    with the body's tag, then the field."""
    field = tuple(errors[0]["loc"])[:2 if tagged else 1]
    same = [e for e in errors if tuple(e["loc"])[:len(field)] == field]
    best = max(same, key=lambda e: (len(e["loc"]), not e["type"].endswith("_type"),
                                    [part for part in e["loc"] if isinstance(part, int)], _expected_its_kind(e)))
    # within that member, the first bad item (`[true, true]` as rewards: item 0)
    return min((e for e in same if _member(e) == _member(best)),
               key=lambda e: [part for part in e["loc"] if isinstance(part, int)])


def _member(error: dict) -> tuple:
    """An error's union member and kind: its location without the list indices, its type."""
    return tuple(part for part in error["loc"] if not isinstance(part, int)), len(error["loc"]), error["type"]


def _expected_its_kind(error: dict) -> bool:
    value, kinds = error.get("input"), _EXPECTED_KINDS.get(error["type"], ())
    return isinstance(value, kinds) and (isinstance(value, bool) == (bool in kinds))


def validation_error(exc: ValidationError | RequestValidationError, tagged: bool = False) -> APIError:
    """`tagged`: a tagged union's error, whose location starts with the member's tag."""
    errors = exc.errors()
    first = _best_match(errors, tagged) if errors else {"loc": (), "msg": "invalid request", "type": ""}
    param = _loc_to_param(tuple(first.get("loc", ()))[1 if tagged else 0:])
    if first.get("type") == "extra_forbidden":
        why = NOT_OFFERED.get(param) or NOT_OFFERED_IN_RESPONSES.get(param)
        message = f"{param} is not supported: {why}" if why else f"Unrecognized request argument supplied: {param}"
        return APIError(400, message, param, "unrecognized_argument")
    if first.get("type") == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    if first.get("type") not in _PYDANTIC_ERRORS:  # one of this server's, whose message names what was sent
        return APIError(400, f"Invalid value for '{param}': {first.get('msg')}.", param, "invalid_value")
    value = first.get("input")
    shown = json.dumps(value)[:80] if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return APIError(400, f"Invalid value for '{param}': {first.get('msg')} (got {shown}).", param, "invalid_value")


def _allowed_methods(request: Request) -> list[str]:
    """The methods of every route whose path matches the request's (server/app.py lists them)."""
    methods: set[str] = set()
    for route in getattr(request.app.state, "api_routes", []):
        if route.path_regex.match(request.url.path):
            methods |= route.methods
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(InvalidParameter)
    async def _invalid_parameter(_: Request, exc: InvalidParameter):
        return error_response(APIError(400, str(exc), exc.param, exc.code))

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError):
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"Not found: no such route. Routes: {', '.join(PLAIN_PATHS)}."
        elif exc.status_code == 405:  # the methods the path takes, over all its routes (RFC 9110)
            allowed = ", ".join(_allowed_methods(request))
            message = f"Method {request.method} is not allowed on this route; it takes {allowed}."
        response = error_response(APIError(exc.status_code, message))
        if exc.status_code == 405:
            response.headers["Allow"] = allowed
        return response

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))
