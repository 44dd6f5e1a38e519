"""`kill -9` with accepted labels pending, as a user would do it: a real server process
(tiny model, DPO, an adapter directory) serves six requests, takes three labels while
another stream keeps the engine busy (so none of them is trained yet), and is killed.
Restarted on the same directory, it trains the three labels, and the three requests
served before the crash still take theirs, as does one answered the moment before the kill."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.servers import TINY_NAME, free_port, wait_for
from trainer.ledger_db import LEDGER_FILE, read_ledger

ROOT = Path(__file__).resolve().parents[1]
SERVER = textwrap.dedent("""
    import sys, uvicorn
    from tests.servers import tiny_app
    from trainer.config import AdapterConfig, TrainConfig
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=AdapterConfig(dir=sys.argv[1]))
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
""")
QUESTION = {"model": TINY_NAME, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def start(adapter_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(adapter_dir), str(port)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, "the server exited"
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(healthy, poll_s=0.1)
    return proc, url


def keep_busy(url: str, stop: threading.Event) -> None:
    """Long requests back to back until `stop` (or the server dies)."""
    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.is_set():
            try:
                client.post("/v1/chat/completions", json={**QUESTION, "max_tokens": 200, "ignore_eos": True,
                                                          "train": False})
            except httpx.TransportError:
                return


def trained(client) -> float:
    lines = client.get("/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("alchemist:trained_entries_total{"))


@pytest.mark.slow  # two server processes
def test_labels_accepted_before_kill_9_are_trained_after_the_restart(tmp_path):
    proc, url = start(tmp_path)
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            ids = [client.post("/v1/chat/completions", json=QUESTION).json()["id"] for _ in range(6)]
            stop = threading.Event()
            busy = [threading.Thread(target=keep_busy, args=(url, stop)) for _ in range(3)]
            for worker in busy:
                worker.start()
            time.sleep(0.5)  # requests keep running: the idle arbiter trains nothing meanwhile
            for completion in ids[:3]:
                r = client.post("/v1/feedback", json={"id": completion, "chosen": "Paris."})
                assert r.status_code == 200, r.text
            pair = client.post("/v1/chat/completions", json={**QUESTION, "n": 2, "temperature": 1.0})
            os.kill(proc.pid, signal.SIGKILL)  # the moment its answer came: the answer is in the ledger already
            proc.wait()
            stop.set()
            for worker in busy:
                worker.join()
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = {row.request.id: row for row in read_ledger(tmp_path / LEDGER_FILE)}
    assert all(rows[i].label is not None for i in ids[:3]) and all(rows[i].label is None for i in ids[3:])
    assert any(rows[i].fate is None for i in ids[:3]), "every label was trained before the kill"

    proc, url = start(tmp_path)
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            wait_for(lambda: trained(client) == 3)
            for completion in ids[3:]:  # served before the crash, labelled after it
                r = client.post("/v1/feedback", json={"id": completion, "chosen": "Paris."})
                assert r.status_code == 200, r.text
            r = client.post("/v1/feedback", json={"id": pair.json()["id"], "chosen_index": 1, "rejected_index": 0})
            assert r.status_code == 200, r.text
            wait_for(lambda: trained(client) == 7)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    rows = {row.request.id: row for row in read_ledger(tmp_path / LEDGER_FILE)}
    assert {rows[i].fate for i in [*ids, pair.json()["id"]]} == {"trained"}
