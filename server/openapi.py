"""The OpenAPI document: every route's request body (the strict models of
server/protocol.py, which the handlers parse by hand to keep OpenAI's error messages),
its response body (server/response_schemas.py), OpenAI's error body for each error
status it can answer, streams as text/event-stream and `/metrics` as Prometheus text.

What each route takes and gives is server/route_table.py's; a route of the app missing
from that table, or one in it that the app lacks, is an error when the document is
built. The document describes this server as configured (`Offered`): a route that would
refuse every valid request here is left out, and feedback shows the one label its
training method takes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server import protocol_training, response_schemas as out
from server.route_table import OPERATIONS, Operation

_REASONS = {400: "Invalid request: OpenAI's error body names the parameter (`param`) and why (`code`).",
            401: "Missing or wrong API key (only when the server has one).",
            404: "Unknown model, completion id or adapter version.",
            409: "Conflict with the current state (a label given twice, an adapter version that cannot load).",
            413: "Request body too large.",
            415: "The body was not sent as JSON (`Content-Type: application/json`).",
            429: "Over capacity: retry after the Retry-After header's seconds.",
            500: "Internal error.",
            503: "The engine is not running (shutting down, or failed), or the feedback ledger cannot be written "
                 "now: retry after the Retry-After header's seconds, or on another replica."}
# (a body past the limit is refused on every route by its Content-Length, a body or none expected)
_COMMON_ERRORS = (401, 413, 500)

_FEEDBACK, _ADAPTERS, _ROLLBACK = ("post", "/v1/feedback"), ("get", "/v1/adapters"), ("post", "/v1/adapters/rollback")
_DELETE_LABEL = ("delete", "/v1/feedback/{completion_id}")
_DELETE_STORED = ("delete", "/v1/chat/completions/{completion_id}")
_DELETE_RESPONSE = ("delete", "/v1/responses/{response_id}")
_STORED_RESPONSE = (("get", "/v1/responses/{response_id}"), ("get", "/v1/responses/{response_id}/input_items"))
# the feedback body, by the label the training method takes (trainer/feedback.py)
_FEEDBACK_BODIES = {"preference": ("A preference between responses of a served completion (DPO)",
                                   (protocol_training.PreferenceTexts, protocol_training.PreferenceIndices)),
                    "rewards": ("One reward per choice of a served group of samples (GRPO)",
                                protocol_training.RewardsFeedback)}


# one server-sent event of a stream (the schema a client validates each event against)
_SSE_EVENT = {"type": "object", "required": ["data"],
              "description": "A server-sent event: `data` is one chunk as JSON (the response's "
                             "`*.chunk` object, or an error body), and the last event's is `[DONE]`.",
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                             "retry": {"type": "integer"}}}


@dataclass(frozen=True)
class Offered:
    """What this server's configuration lets a client do."""

    # the label POST /v1/feedback takes ("preference" or "rewards"); None: it refuses every label
    feedback: str | None
    # adapters are saved (--adapter-dir), so POST /v1/adapters/rollback can make one live
    rollback: bool
    # there is an adapter for GET /v1/adapters to describe (trained, or served frozen)
    adapters: bool
    # training is on: the server keeps completions (and labels) that a client may delete
    stores: bool = False
    # finished responses are stored (server/response_store.py): retrieved, listed, deleted
    responses: bool = False
    # the model names requests may give (any other is a 404); none: any string
    models: tuple[str, ...] = ()


def served_operations(offered: Offered) -> dict[tuple[str, str], Operation]:
    """The table's operations that can succeed on this server, feedback with its own body.
    The others answer 400 to every valid request here: offering them would promise a
    success the server never gives (schemathesis' positive_data_acceptance holds a
    document to that)."""
    operations = dict(OPERATIONS)
    if offered.feedback is None:
        del operations[_FEEDBACK], operations[_DELETE_LABEL]
    else:
        summary, body = _FEEDBACK_BODIES[offered.feedback]
        operations[_FEEDBACK] = replace(operations[_FEEDBACK], summary=summary, request=body)
    if not offered.adapters:
        del operations[_ADAPTERS]
    if not offered.rollback:
        del operations[_ROLLBACK]
    if not offered.stores:
        operations.pop(_DELETE_LABEL, None)
        del operations[_DELETE_STORED]
    if not offered.responses:
        for operation in _STORED_RESPONSE:
            del operations[operation]
        if not offered.stores:
            del operations[_DELETE_RESPONSE]
    return operations


def openapi_document(routes: list, title: str, version: str, vocab_size: int, offered: Offered,
                     secured: Callable[[str], bool] = lambda path: False) -> dict:
    """The document for `routes` (the app's) on a server that offers `offered`; token ids
    are below `vocab_size`; `secured(path)`: the path takes a bearer key (server/guards.py)."""
    document = get_openapi(title=title, version=version, routes=routes,
                           description="An OpenAI-compatible server that trains a LoRA adapter online on what "
                                       "it serves.")
    served = served_operations(offered)
    requests = {model for op in served.values() for model in _request_models(op)}
    responses = {op.response for op in served.values() if op.response} | {out.ErrorResponse}
    by_name = lambda model: model.__name__  # noqa: E731 - a deterministic order
    _, definitions = models_json_schema([(m, "validation") for m in sorted(requests, key=by_name)]
                                        + [(m, "serialization") for m in sorted(responses, key=by_name)],
                                        ref_template="#/components/schemas/{model}")
    components = document.setdefault("components", {})
    components["schemas"] = _named_models(_bound_token_ids(definitions.get("$defs", {}), vocab_size),
                                          {model.__name__ for model in requests}, offered.models)
    if any(secured(path) for path in document["paths"]):
        components["securitySchemes"] = {"bearer": {
            "type": "http", "scheme": "bearer",
            "description": "The API key; on /v1/adapters routes the admin key, where the server has one."}}
    routed = set()
    for path, methods in list(document["paths"].items()):
        for method, operation in list(methods.items()):
            if (method, path) not in OPERATIONS:
                raise KeyError(f"{method.upper()} {path} is not in server/route_table.py's OPERATIONS")
            routed.add((method, path))
            if (method, path) in served:
                methods[method] = _operation(operation, served[method, path], secured(path),
                                             offered.models)
            else:
                del methods[method]
        if not methods:
            del document["paths"][path]
    missing = set(OPERATIONS) - routed
    if missing:
        raise KeyError(f"OPERATIONS lists routes the app does not have: {sorted(missing)}")
    return document


def _request_models(operation: Operation) -> tuple[type[BaseModel], ...]:
    request = operation.request
    return () if request is None else request if isinstance(request, tuple) else (request,)


def _bound_token_ids(schema, vocab_size: int):
    """The schema with every token id (protocol_fields.TokenId) bounded by the served vocabulary."""
    if isinstance(schema, dict):
        bounded = {key: _bound_token_ids(value, vocab_size) for key, value in schema.items() if key != "x-token-id"}
        if schema.get("x-token-id"):
            bounded["maximum"] = vocab_size - 1
        return bounded
    if isinstance(schema, list):
        return [_bound_token_ids(item, vocab_size) for item in schema]
    return schema


def _named_models(schemas: dict, request_names: set[str], served_names: tuple[str, ...]) -> dict:
    """The request schemas with their `model` field one of `served_names` (a fuzzer then
    reaches past the 404 of an unknown model; a client learns the names from the document)."""
    for name in request_names & set(schemas) if served_names else ():
        field = schemas[name].get("properties", {}).get("model")
        for branch in field.get("anyOf", [field]) if field is not None else ():
            if branch.get("type") == "string":
                branch["enum"] = list(dict.fromkeys(served_names))
    return schemas


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _operation(generated: dict, spec: Operation, secured: bool, served_names: tuple[str, ...]) -> dict:
    operation = {"summary": spec.summary, "operationId": generated["operationId"]}
    if "parameters" in generated:
        operation["parameters"] = generated["parameters"]
        for parameter in operation["parameters"]:
            if parameter["name"] == "model_id" and served_names:
                parameter["schema"]["enum"] = list(dict.fromkeys(served_names))
    models = _request_models(spec)
    if models:
        schema = _ref(models[0]) if len(models) == 1 else {"oneOf": [_ref(m) for m in models]}
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    if spec.response is None:
        content = {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}
    else:
        content = {"application/json": {"schema": _ref(spec.response)}}
        if spec.streams:
            content["text/event-stream"] = {"schema": _SSE_EVENT}
    responses = {"200": {"description": "Success", "content": content}}
    errors = set(spec.declared_errors) | set(_COMMON_ERRORS)
    if not secured:
        errors.discard(401)
    for status in sorted(errors):
        responses[str(status)] = {"description": _REASONS[status],
                                  "content": {"application/json": {"schema": _ref(out.ErrorResponse)}}}
    operation["responses"] = responses
    if secured:
        operation["security"] = [{"bearer": []}]
    return operation
