"""Builds the server app from a config (the parts come from server/build.py, the
composition root) and runs it under uvicorn.

Start-up order: model -> engine -> trainer (resuming the latest saved adapter when
`adapter.dir` is set) -> arbiter -> worker thread -> HTTP. Shutdown (SIGINT/SIGTERM via uvicorn)
stops accepting connections, then stops the engine thread (requests still in flight
receive an error rather than hanging), then saves the final adapter version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn
from fastapi import FastAPI

from engine.model_loader import load
from server.app import ServerState, build_app
from server.build import build_stack
from server.config import AlchemistConfig
from server.generation_config import log_defaults, sampling_defaults
from server.guards import GuardConfig

logger = logging.getLogger(__name__)


def build_server(config: AlchemistConfig, model=None, tokenizer=None, model_name: str | None = None) -> FastAPI:
    """The app for `config`; pass `model` and `tokenizer` to serve an in-memory model."""
    embedded = model is None and not config.model.model
    if model is None:
        model, tokenizer, model_name = load(config.model)
    setting = config.model.generation_config
    defaults = sampling_defaults(setting, model, embedded)
    log_defaults(defaults, setting)
    name = config.model.served_model_name or model_name or "model"
    stack = build_stack(config, model, tokenizer, name)
    async_engine, training, name = stack.async_engine, stack.training, stack.name
    keeps_client_prompt = training is not None and training.recorder.keeps_client_prompt
    state = ServerState(async_engine, tokenizer, name, config.model.max_model_len, stack.metrics, training,
                        stack.served_adapter, keeps_client_prompt=keeps_client_prompt,
                        sampling_defaults=defaults)
    server = config.server
    app = build_app(state, GuardConfig(server.api_key, server.admin_key,
                                       config.scheduler.max_num_seqs + server.max_queued_requests,
                                       server.max_body_bytes))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        logger.info("serving %s (max_model_len=%d, max_num_seqs=%d)", name, config.model.max_model_len,
                    config.scheduler.max_num_seqs)
        yield
        await async_engine.stop()
        if training is not None:
            await asyncio.to_thread(training.close)  # the final adapter version, when saving is on
        logger.info("shutdown complete")

    app.router.lifespan_context = lifespan
    return app


def run(app: FastAPI, config: AlchemistConfig) -> None:
    uvicorn.run(app, host=config.server.host, port=config.server.port, log_level="info",
                timeout_graceful_shutdown=10)
