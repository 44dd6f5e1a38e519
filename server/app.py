"""The HTTP app: the OpenAI routes (server/routes_openai.py, and the Responses API's in
server/responses_api.py and server/responses_stored.py), the admin routes
(server/routes_admin.py), vLLM's tokenizer routes (server/routes_tokens.py), OpenAI-style
errors (server/errors.py), the request guard (authentication, body size, capacity:
server/guards.py) and the OpenAPI document (server/openapi.py)."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.routing import APIRoute

from server.errors import install_error_handlers
from server.guards import GuardConfig, RequestGuard
from server.openapi import Offered, openapi_document
from server.route_table import expected_statuses
from server.responses_api import responses_router
from server.responses_stored import stored_router
from server.routes_admin import admin_router
from server.routes_openai import openai_router
from server.routes_tokens import tokens_router
from server.state import ServerState

__all__ = ["ServerState", "build_app"]


def build_app(state: ServerState, guard: GuardConfig | None = None) -> FastAPI:
    app = FastAPI(title="alchemist", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    guard = guard or GuardConfig()
    app.add_middleware(RequestGuard, config=guard, count_response=state.metrics.count_response)
    if guard.allowed_origins:  # outside the guard: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(guard.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    state.metrics.expect_responses(expected_statuses(bool(guard.api_key), bool(guard.admin_key)))
    app.state.alchemist = state
    routers = [admin_router(state), openai_router(state), responses_router(state), stored_router(state),
               tokens_router(state)]
    for router in routers:
        _add_head_routes(router)
        app.include_router(router)
    # every route, for the Allow header of a 405 (server/errors.py)
    app.state.api_routes = [route for router in routers for route in router.routes if isinstance(route, APIRoute)]

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app.routes, app.title, app.version, state.engine.vocab_size,
                                                  offered(state), secured=lambda path: bool(guard.key_for(path)))
        return app.openapi_schema

    app.openapi = openapi
    return app


def offered(state: ServerState) -> Offered:
    """What this server's configuration takes, for its OpenAPI document."""
    training = state.training
    if training is None:  # feedback and rollback answer 400; an adapter only if one is served frozen
        return Offered(feedback=None, rollback=False, adapters=state.served_adapter is not None,
                       responses=state.responses is not None, models=state.model_names)
    method = training.method
    return Offered(feedback=method.label_kind if method.uses_feedback else None,
                   rollback=training.status().saves is not None, adapters=True, stores=True,
                   responses=state.responses is not None, models=state.model_names)


def _add_head_routes(router: APIRouter) -> None:
    """HEAD wherever GET is (RFC 9110), answered by the GET handler (servers drop the body);
    kept out of the schema, where it would repeat the GET operations."""
    for route in list(router.routes):
        if isinstance(route, APIRoute) and "GET" in route.methods:
            router.add_api_route(route.path, route.endpoint, methods=["HEAD"], include_in_schema=False,
                                 response_class=route.response_class)
