"""The OpenAPI document: every route's request body (the strict models of
server/protocol.py, which the handlers parse by hand to keep OpenAI's error messages),
its response body (server/response_schemas.py), OpenAI's error body for each error
status it can answer, streams as text/event-stream and `/metrics` as Prometheus text.

`OPERATIONS` is the one table of what each route takes and gives; a route missing from
it is an error when the document is built, so none goes undocumented.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from server import protocol, response_schemas as out

_REASONS = {400: "Invalid request: OpenAI's error body names the parameter (`param`) and why (`code`).",
            401: "Missing or wrong API key (only when the server has one).",
            404: "Unknown model, completion id or adapter version.",
            409: "Conflict with the current state (a label given twice, an adapter version that cannot load).",
            413: "Request body too large.",
            429: "Over capacity: retry after the Retry-After header's seconds.",
            500: "Internal error.",
            503: "The engine is not running (shutting down, or failed): retry on another replica."}
_COMMON_ERRORS = (401, 500)


@dataclass(frozen=True)
class Operation:
    summary: str
    response: type[BaseModel] | None  # None: Prometheus text
    # the body's model, or the models of a body that takes one of several shapes
    request: type[BaseModel] | tuple[type[BaseModel], ...] | None = None
    errors: tuple[int, ...] = ()
    streams: bool = False  # `"stream": true` answers text/event-stream


_GENERATION_ERRORS = (400, 404, 413, 429, 503)
OPERATIONS: dict[tuple[str, str], Operation] = {
    ("get", "/health"): Operation("Liveness: 200 while the engine runs", out.Health, errors=(503,)),
    ("get", "/metrics"): Operation("Prometheus metrics", None),
    ("get", "/v1/models"): Operation("The served model", out.ModelList),
    ("get", "/v1/models/{model_id}"): Operation("One model", out.ModelCard, errors=(404,)),
    ("post", "/v1/chat/completions"): Operation("Chat completion (OpenAI's)", out.ChatCompletion,
                                                protocol.ChatCompletionRequest, _GENERATION_ERRORS, streams=True),
    ("post", "/v1/completions"): Operation("Text completion (OpenAI's)", out.Completion, protocol.CompletionRequest,
                                           _GENERATION_ERRORS, streams=True),
    ("post", "/v1/feedback"): Operation("A label for a served completion: preference or rewards",
                                        out.FeedbackAccepted, protocol.FeedbackRequest, (400, 404, 409, 413)),
    ("get", "/v1/adapters"): Operation("The live adapter and the saved versions", out.AdapterStatus, errors=(400,)),
    ("post", "/v1/adapters/rollback"): Operation("Make a saved adapter version the live one", out.AdapterStatus,
                                                 protocol.RollbackRequest, (400, 404, 409, 413, 503)),
    ("post", "/tokenize"): Operation("Tokenize a prompt or chat messages (vLLM's)", out.TokenizeResponse,
                                     (protocol.TokenizePromptRequest, protocol.TokenizeChatRequest), (400, 404, 413)),
    ("post", "/detokenize"): Operation("Token ids back to text (vLLM's)", out.DetokenizeResponse,
                                       protocol.DetokenizeRequest, (400, 404, 413)),
}


def openapi_document(routes: list, title: str, version: str, vocab_size: int, secured: bool = False) -> dict:
    """The document for `routes` (the app's); token ids are below `vocab_size`;
    `secured`: `/v1/*` takes a bearer API key."""
    document = get_openapi(title=title, version=version, routes=routes,
                           description="An OpenAI-compatible server that trains a LoRA adapter online on what "
                                       "it serves.")
    requests = {model for op in OPERATIONS.values() for model in _request_models(op)}
    responses = {op.response for op in OPERATIONS.values() if op.response} | {out.ErrorResponse}
    by_name = lambda model: model.__name__  # noqa: E731 - a deterministic order
    _, definitions = models_json_schema([(m, "validation") for m in sorted(requests, key=by_name)]
                                        + [(m, "serialization") for m in sorted(responses, key=by_name)],
                                        ref_template="#/components/schemas/{model}")
    components = document.setdefault("components", {})
    components["schemas"] = _bound_token_ids(definitions.get("$defs", {}), vocab_size)
    if secured:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    documented = set()
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            spec = OPERATIONS.get((method, path))
            if spec is None:
                raise KeyError(f"{method.upper()} {path} is not in server/openapi.py's OPERATIONS")
            documented.add((method, path))
            methods[method] = _operation(operation, spec, secured and path.startswith("/v1/"))
    missing = set(OPERATIONS) - documented
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


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _operation(generated: dict, spec: Operation, secured: bool) -> dict:
    operation = {"summary": spec.summary, "operationId": generated["operationId"]}
    if "parameters" in generated:
        operation["parameters"] = generated["parameters"]
    models = _request_models(spec)
    if models:
        schema = _ref(models[0]) if len(models) == 1 else {"oneOf": [_ref(m) for m in models]}
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    if spec.response is None:
        content = {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}
    else:
        content = {"application/json": {"schema": _ref(spec.response)}}
        if spec.streams:
            content["text/event-stream"] = {"schema": {
                "type": "string", "description": "Server-sent events: one `data: {chunk}` per delta, then "
                                                 "`data: [DONE]`."}}
    responses = {"200": {"description": "Success", "content": content}}
    errors = set(spec.errors) | set(_COMMON_ERRORS)
    if not secured:
        errors.discard(401)
    for status in sorted(errors):
        responses[str(status)] = {"description": _REASONS[status],
                                  "content": {"application/json": {"schema": _ref(out.ErrorResponse)}}}
    operation["responses"] = responses
    if secured:
        operation["security"] = [{"bearer": []}]
    return operation
