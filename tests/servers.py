"""Serving a tiny in-process model over real HTTP (uvicorn on a loopback port) for tests."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import uvicorn

from bench.launch import free_port  # noqa: F401 - re-exported for tests
from server.config import ServerConfig
from server.read_deadline import uvicorn_config
from server.serve import build_server
from tests.conftest import make_config
from tests.tiny import tiny_model, tiny_tokenizer

TINY_NAME = "tiny-llama"


def tiny_app(family: str = "llama", *, train=None, adapter=None, server=None, offload=None, model=None,
             tokenizer=None, **config_kwargs):
    """A server app on a tiny model; `train`, `adapter`, `server`, `offload` replace those config sections."""
    config = make_config(**config_kwargs)
    sections = {k: v for k, v in (("train", train), ("adapter", adapter), ("server", server), ("offload", offload))
                if v is not None}
    config = dataclasses.replace(config, **sections)
    return build_server(config, model=model or tiny_model(family), tokenizer=tokenizer or tiny_tokenizer(),
                        model_name=TINY_NAME)


def long_context_app(**kwargs):
    """A tiny app with room for tools: their fallback prompt is ~700 tokens of the tiny tokenizer's."""
    return tiny_app(model=tiny_model(max_positions=2048), max_model_len=2048, kv_cache_bytes=16 << 20,
                    max_num_batched_tokens=1024, **kwargs)


class ServerThread:
    """Runs an app under uvicorn in a thread; use as a context manager."""

    def __init__(self, app, server: ServerConfig = ServerConfig()):
        self.app = app
        # bound here and handed to uvicorn: a port picked free and bound later could be
        # taken in between (another test process picking the same one)
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, server, log_level="warning"))  # as the server runs
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 120  # generous: a loaded CI machine starts slowly, and no test is about it
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.socket.close()


# how long a test waits for something that takes milliseconds on an idle machine before
# it fails: generous, since the CI machine may be loaded (no test depends on its speed)
PATIENCE_S = 120.0


def wait_for(predicate, timeout: float = PATIENCE_S, poll_s: float = 0.005) -> float:
    """Waits until `predicate()` holds; returns the seconds it took (AssertionError on timeout)."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError("condition not reached in time")
        time.sleep(poll_s)
    return time.monotonic() - started
