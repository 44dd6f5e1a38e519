"""The server's routes, in one table: what each takes and gives.

The routers (server/routes_*.py) serve exactly these (tests/test_openapi.py checks);
the request guard's route labels (server/guards.py), the 404 message (server/errors.py)
and the OpenAPI document (server/openapi.py) are read off this table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import BaseModel

from server import protocol, protocol_responses, protocol_training, response_objects, response_schemas as out


@dataclass(frozen=True)
class Operation:
    summary: str
    response: type[BaseModel] | None  # None: Prometheus text
    # the body's model, or the models of a body that takes one of several shapes
    request: type[BaseModel] | tuple[type[BaseModel], ...] | None = None
    errors: tuple[int, ...] = ()
    streams: bool = False  # `"stream": true` answers text/event-stream

    @property
    def declared_errors(self) -> tuple[int, ...]:
        """Its errors, with 415 where it takes a body (server/parsing.py refuses one not sent as JSON)."""
        return tuple(sorted({*self.errors, *((415,) if self.request is not None else ())}))


_GENERATION_ERRORS = (400, 404, 413, 429, 503)
# in the order the 404 message names them
OPERATIONS: dict[tuple[str, str], Operation] = {
    ("post", "/v1/chat/completions"): Operation("Chat completion (OpenAI's)", out.ChatCompletion,
                                                protocol.ChatCompletionRequest, _GENERATION_ERRORS, streams=True),
    ("post", "/v1/responses"): Operation("A response (OpenAI's Responses API), served as a chat completion",
                                         response_objects.ModelResponse, protocol_responses.ResponsesRequest,
                                         _GENERATION_ERRORS, streams=True),
    ("post", "/v1/completions"): Operation("Text completion (OpenAI's)", out.Completion, protocol.CompletionRequest,
                                           _GENERATION_ERRORS, streams=True),
    ("get", "/v1/models"): Operation("The served model", out.ModelList),
    ("get", "/v1/models/{model_id}"): Operation("One model", out.ModelCard, errors=(404,)),
    ("post", "/v1/feedback"): Operation("A label for a served completion: preference or rewards",
                                        out.FeedbackAccepted, protocol_training.FeedbackRequest,
                                        (400, 404, 409, 413, 503)),
    ("delete", "/v1/feedback/{completion_id}"): Operation(
        "Delete a completion's label (it is no longer trained on, nor kept)", out.FeedbackDeleted,
        errors=(400, 404, 409, 503)),
    ("delete", "/v1/chat/completions/{completion_id}"): Operation(
        "Delete what the server keeps of a completion: its request and label (OpenAI's stored completions)",
        out.CompletionDeleted, errors=(400, 404, 409, 503)),
    ("get", "/v1/responses/{response_id}"): Operation("A stored response (OpenAI's)", response_objects.ModelResponse,
                                                       errors=(400, 404, 503)),  # 503: its replica did not answer
    ("get", "/v1/responses/{response_id}/input_items"): Operation(
        "A stored response's input items (OpenAI's)", response_objects.InputItemList, errors=(400, 404, 503)),
    ("delete", "/v1/responses/{response_id}"): Operation(
        "Delete what the server keeps of a response: its request and label (OpenAI's)", out.ResponseDeleted,
        errors=(400, 404, 409, 503)),
    ("get", "/v1/adapters"): Operation("The live adapter and the saved versions", out.AdapterStatus,
                                       errors=(400, 503)),  # 503: with replicas, one did not answer
    ("post", "/v1/adapters/rollback"): Operation("Make a saved adapter version the live one", out.AdapterStatus,
                                                 protocol_training.RollbackRequest, (400, 404, 409, 413, 503)),
    ("post", "/tokenize"): Operation("Tokenize a prompt or chat messages (vLLM's)", out.TokenizeResponse,
                                     (protocol.TokenizePromptRequest, protocol.TokenizeChatRequest), (400, 404, 413)),
    ("post", "/detokenize"): Operation("Token ids back to text (vLLM's)", out.DetokenizeResponse,
                                       protocol.DetokenizeRequest, (400, 404, 413)),
    ("get", "/tokenizer_info"): Operation("The served tokenizer's special tokens and chat template (vLLM's)",
                                          out.TokenizerInfo),
    ("get", "/health"): Operation("Liveness: 200 while the engine runs", out.Health, errors=(503,)),
    ("get", "/version"): Operation("The server's version (vLLM's route)", out.Version),
    ("get", "/metrics"): Operation("Prometheus metrics", None),
}

# the paths without a path parameter, once each, in the table's order
PLAIN_PATHS: tuple[str, ...] = tuple(dict.fromkeys(path for _, path in OPERATIONS if "{" not in path))
# the paths with one, as templates (`/v1/feedback/{completion_id}`), once each
TEMPLATED_PATHS: tuple[str, ...] = tuple(dict.fromkeys(path for _, path in OPERATIONS if "{" in path))


def route_of(path: str) -> str | None:
    """The table's path a request's path is (a template, for one with a parameter, whose
    last parameter a model's id may fill with slashes and all); None if none."""
    if path in PLAIN_PATHS:
        return path
    for patterns in (_SEGMENT_PATTERNS, _TRAILING_PATTERNS):  # a template whose segments all match comes first
        template = next((t for t, pattern in patterns.items() if pattern.fullmatch(path)), None)
        if template is not None:
            return template
    return None


def _pattern(template: str, last: str) -> re.Pattern:
    """A template's paths: each parameter one segment, the last one `last`."""
    pieces = re.split(r"\{[^}]+\}", template)
    return re.compile("[^/]+".join(map(re.escape, pieces[:-1])) + last + re.escape(pieces[-1]))


_SEGMENT_PATTERNS = {template: _pattern(template, "[^/]+") for template in TEMPLATED_PATHS}
_TRAILING_PATTERNS = {template: _pattern(template, ".+") for template in TEMPLATED_PATHS}


def expected_statuses(api_key: bool, admin_key: bool) -> dict[str, tuple[int, ...]]:
    """Each route's status codes as the table declares them (200 and its errors), with 499
    (a client gone), 500 (an unhandled error) and 401 where a key guards it (every `/v1/`
    route with an API key; the adapter routes with an admin key); and "other"'s."""
    statuses: dict[str, set[int]] = {}
    for (_, path), operation in OPERATIONS.items():
        keyed = path.startswith("/v1/") and (api_key or (admin_key and path.startswith("/v1/adapters")))
        statuses.setdefault(path, {200, 499, 500, *([401] if keyed else [])}).update(operation.declared_errors)
    return {**{path: tuple(sorted(codes)) for path, codes in statuses.items()}, "other": (404, 405, 500)}
