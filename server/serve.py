"""Builds the whole server from a config and runs it under uvicorn.

Start-up order: model -> engine -> trainer (resuming the latest saved adapter when
`adapter.dir` is set) -> worker thread -> HTTP. Shutdown (SIGINT/SIGTERM via uvicorn)
stops accepting connections, then stops the engine thread (requests still in flight
receive an error rather than hanging), then saves the final adapter version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn
from fastapi import FastAPI

from engine.async_engine import AsyncEngine
from server.config import AlchemistConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import load_model
from server.app import ServerState, build_app
from server.guards import GuardConfig
from server.metrics import ServingMetrics
from trainer.adapter_store import AdapterCheckpointer, AdapterStore
from trainer.trainer import Trainer

logger = logging.getLogger(__name__)


def build_server(config: AlchemistConfig, model=None, tokenizer=None, model_name: str | None = None) -> FastAPI:
    """The app for `config`; pass `model` and `tokenizer` to serve an in-memory model."""
    if model is None:
        model, tokenizer, model_name = load_model(config.model.model, config.model.dtype, config.model.device)
    name = config.model.served_model_name or model_name or "model"
    engine = LLMEngine(model, tokenizer, config)
    metrics = ServingMetrics(name, engine.cache_info())
    trainer = None
    if config.train.mode != "off":
        trainer = Trainer(engine, config.train)
        metrics.add_trainer(trainer)
        logger.info("online training: %s, LoRA rank %d, learning rate %g", config.train.mode,
                    config.train.lora_rank, config.train.learning_rate)
    if config.adapter.dir and trainer is None:
        logger.warning("adapter.dir is set but training is off (train.mode = off): no adapter is loaded from or "
                       "saved to %s", config.adapter.dir)
    elif config.adapter.dir:
        trainer.enable_checkpoints(AdapterCheckpointer(AdapterStore(config.adapter.dir, config.adapter.keep),
                                                       config.adapter.save_every))
    observers = [metrics] + ([trainer] if trainer else [])
    async_engine = AsyncEngine(engine, observers=observers, training=trainer, arbiter=config.arbiter)
    metrics.add_engine(async_engine)
    state = ServerState(async_engine, tokenizer, name, config.model.max_model_len, metrics, trainer)
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
        if trainer is not None:
            await asyncio.to_thread(trainer.close)  # the final adapter version, when saving is on
        logger.info("shutdown complete")

    app.router.lifespan_context = lifespan
    return app


def run(app: FastAPI, config: AlchemistConfig) -> None:
    uvicorn.run(app, host=config.server.host, port=config.server.port, log_level="info",
                timeout_graceful_shutdown=10)
