"""Builds the server app from a config (the parts come from server/build.py, the
composition root) and runs it under uvicorn.

Start-up order: model -> engine -> trainer (resuming the latest saved adapter when
`adapter.dir` is set) -> arbiter -> worker thread -> HTTP. A data-parallel replica
(server/replicas.py) first joins its group and learns the others' private addresses; its
trainer starts from rank 0's adapter; it serves on the shared public port and on its
private one. Shutdown (SIGINT/SIGTERM via uvicorn)
stops accepting connections, then stops the engine thread (requests still in flight
receive an error rather than hanging), then saves the final adapter version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI
from uvicorn.config import STARTUP_FAILURE

from engine.model_loader import load
from server.app import ServerState, build_app
from server.build import build_stack
from server.config import AlchemistConfig
from server.gc_freeze import freeze_startup_objects
from server.generation_config import log_defaults, sampling_defaults
from server.fanout import Peers
from server.guards import GuardConfig
from server.read_deadline import uvicorn_config
from server.response_store import RESPONSES_FILE, ResponseStore
from server.replicas import ensure_port_free, exchange_addresses, mark_serving, private_socket, public_socket
from trainer.replicated import Replica

logger = logging.getLogger(__name__)


def build_server(config: AlchemistConfig, model=None, tokenizer=None, model_name: str | None = None,
                 replica: Replica | None = None, peers: Peers | None = None) -> FastAPI:
    """The app for `config`; pass `model` and `tokenizer` to serve an in-memory model;
    `replica` and `peers`: this data-parallel replica's place and the others' addresses."""
    embedded = model is None and not config.model.model
    if model is None:
        model, tokenizer, model_name = load(config.model)
    setting = config.model.generation_config
    defaults = sampling_defaults(setting, model, embedded)
    log_defaults(defaults, setting)
    names = [n.strip() for n in config.model.served_model_name.split(",") if n.strip()] or [model_name or "model"]
    stack = build_stack(config, model, tokenizer, names[0], replica)
    if config.model.seed >= 0:  # once everything is built: what draws from the generators now is sampling
        torch.manual_seed(config.model.seed)
    async_engine, training, name = stack.async_engine, stack.training, stack.name
    keeps_client_prompt = training is not None and training.recorder.keeps_client_prompt
    aliases = tuple(names[1:]) if name == names[0] else ()  # a frozen adapter is served under its own name
    responses = response_store(config)
    if responses is not None:
        stack.metrics.add_response_store(responses)
    state = ServerState(async_engine, tokenizer, name, config.model.max_model_len, stack.metrics, training,
                        stack.served_adapter, aliases, keeps_client_prompt=keeps_client_prompt,
                        sampling_defaults=defaults, reasoning_parser=config.server.reasoning_parser,
                        replica=replica, peers=peers, responses=responses)
    server = config.server
    app = build_app(state, GuardConfig(server.api_key, server.admin_key,
                                       config.scheduler.max_num_seqs + server.max_queued_requests,
                                       server.max_body_bytes, peers.private_port if peers else None,
                                       server.allowed_origins))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        logger.info("serving %s (max_model_len=%d, max_num_seqs=%d)", name, config.model.max_model_len,
                    config.scheduler.max_num_seqs)
        yield
        await async_engine.stop()
        if training is not None:
            await asyncio.to_thread(training.close)  # the final adapter version, when saving is on
        if peers is not None:
            await peers.close()
        if state.responses is not None:
            state.responses.close()
        logger.info("shutdown complete")

    app.router.lifespan_context = lifespan
    return app


def response_store(config: AlchemistConfig) -> ResponseStore | None:
    """The stored responses: beside the feedback ledger where training keeps one (so that a
    conversation outlives a restart), else in memory; None when none are to be kept."""
    if config.server.max_stored_responses == 0:
        return None
    on_disk = config.train.mode != "off" and config.adapter.dir and config.ledger.enabled
    return ResponseStore(Path(config.adapter.dir) / RESPONSES_FILE if on_disk else None,
                         config.server.max_stored_responses, config.server.max_stored_response_bytes)


def run(app: FastAPI, config: AlchemistConfig) -> None:
    logger.info("%d start-up objects frozen out of garbage collection", freeze_startup_objects())
    server = uvicorn.Server(uvicorn_config(app, config.server, host=config.server.host, port=config.server.port,
                                           log_level=_uvicorn_level(), timeout_graceful_shutdown=10))
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises the SIGINT it shut down on again (as uvicorn.run)
        server.run()
    if not server.started:  # it could not start (the port taken): uvicorn.run's exit status
        raise SystemExit(STARTUP_FAILURE)


def _uvicorn_level() -> str:
    """The root logger's level (`--log-level`): WARNING keeps uvicorn's per-request lines out too."""
    return logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()


def run_replica(config: AlchemistConfig, replica: Replica) -> None:
    """Runs one data-parallel replica (its group joined): on the public port, shared with
    the others, and on a private one they ask it on."""
    import torch.distributed as dist

    if replica.local_rank == 0:  # before any replica of the group binds it
        ensure_port_free(config.server.host, config.server.port)
    private, address = private_socket(replica)
    peers = Peers(replica.rank, exchange_addresses(address))
    app = build_server(config, replica=replica, peers=peers)
    public = public_socket(config.server.host, config.server.port)
    logger.info("replica %d serving on port %d (private %s)", replica.rank, config.server.port, address)
    server = uvicorn.Server(uvicorn_config(app, config.server, log_level=_uvicorn_level(),
                                           timeout_graceful_shutdown=10))
    logger.info("%d start-up objects frozen out of garbage collection", freeze_startup_objects())
    mark_serving(replica)
    try:
        server.run(sockets=[public, private])
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it shut down on again, once done (as uvicorn.run, quietly)
        pass
    finally:
        dist.destroy_process_group()
