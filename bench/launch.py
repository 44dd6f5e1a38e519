"""Starting `alchemist serve` in a subprocess on a free loopback port (benchmarks and
end-to-end tests): yields the URL once /health answers, and terminates it afterwards."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(*flags: str, startup_timeout_s: float = 300.0, env: dict[str, str] | None = None):
    """The first start may convert the embedded model (about 20 s); the log is kept in a
    temporary file named in any error. Yields the server's URL."""
    with server_process(*flags, startup_timeout_s=startup_timeout_s, env=env) as (url, _):
        yield url


@contextlib.contextmanager
def server_process(*flags: str, startup_timeout_s: float = 300.0, env: dict[str, str] | None = None):
    """As `running_server`, yielding (url, subprocess.Popen); `env` adds environment variables."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix=f"alchemist-{port}-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT, cwd=_REPO, env={**os.environ, **(env or {})})
    proc.log_path = log.name  # the server's output, for callers that check what it said
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.time() > deadline:
                raise RuntimeError(f"server did not become healthy; see {log.name}")
            time.sleep(0.3)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
