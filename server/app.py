"""The HTTP app: the OpenAI routes (server/routes_openai.py), the admin routes
(server/routes_admin.py), OpenAI-style errors (server/errors.py) and the request guard
(authentication, body size, capacity: server/guards.py)."""

from __future__ import annotations

from fastapi import FastAPI

from server.errors import install_error_handlers
from server.guards import GuardConfig, RequestGuard
from server.routes_admin import admin_router
from server.routes_openai import openai_router
from server.state import ServerState

__all__ = ["ServerState", "build_app"]


def build_app(state: ServerState, guard: GuardConfig | None = None) -> FastAPI:
    app = FastAPI(title="alchemist", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, config=guard or GuardConfig(), count_response=state.metrics.count_response)
    app.state.alchemist = state
    app.include_router(admin_router(state))
    app.include_router(openai_router(state))
    return app
