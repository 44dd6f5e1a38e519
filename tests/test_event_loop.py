"""The asyncio loop never runs tensor code (DESIGN.md invariant): releasing a recording
(freeing its graph and the offloader's copies) refuses to run on it, and under a real
server every release — an aborted DPO request, a label timeout, a trained entry — runs
on the device thread."""

import asyncio
import threading

import httpx
import pytest

from engine.recording import RecordedPrefill
from tests.servers import TINY_NAME, ServerThread, tiny_app, wait_for
from trainer.config import TrainConfig


def test_releasing_a_recording_on_the_event_loop_raises():
    recording = RecordedPrefill([1, 2, 3], 0, [], None, None, True, 3)

    async def on_the_loop():
        recording.release()

    with pytest.raises(RuntimeError, match="must not run on the asyncio event loop"):
        asyncio.run(on_the_loop())
    recording.release()  # off the loop: fine


def test_every_release_under_the_server_runs_on_the_device_thread(monkeypatch):
    threads = []
    release = RecordedPrefill.release

    def spying_release(self):
        threads.append(threading.current_thread().name)
        release(self)

    monkeypatch.setattr(RecordedPrefill, "release", spying_release)
    app = tiny_app(max_model_len=4096, kv_cache_bytes=16 << 20,
                   train=TrainConfig(mode="dpo", lora_rank=4, label_timeout_s=3.0))
    trainer = app.state.alchemist.training
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=300) as client:
        # labelled at once: its label must beat the timeout by one round trip, not by the whole test
        labelled = client.post("/v1/chat/completions", json=body).json()["id"]
        assert client.post("/v1/feedback", json={"id": labelled, "chosen": "Hi!"}).status_code == 200
        client.post("/v1/chat/completions", json=body)  # never labelled: expires
        with client.stream("POST", "/v1/chat/completions",  # aborted by its client: dropped
                           json={**body, "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if '"content"' in line and '""' not in line:
                    break
        wait_for(lambda: trainer.status().cache.ended.get("trained", 0) == 1
                 and trainer.status().cache.ended.get("expired", 0) == 1
                 and trainer.status().cache.ended.get("dropped", 0) == 1)
    assert len(threads) >= 3
    assert all(name.startswith("alchemist-device") for name in threads), threads
