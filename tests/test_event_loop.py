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


@pytest.mark.parametrize("route, body", [
    ("/tokenize", {"prompt": "Hello there"}),
    ("/v1/completions", {"prompt": "Hello there", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                              "structured_outputs": {"choice": ["yes", "no"]}}),
])
def test_a_requests_tokenizing_and_grammar_run_off_the_event_loop(monkeypatch, route, body):
    """A 4 MB prompt held the loop 5 s in the tokenizer, 60,000 choices 3 s in llguidance,
    and every other client waited (an outside pass): while one request's CPU work is held
    here, another client is answered."""
    from engine.structured import GrammarCompiler

    held, release = threading.Event(), threading.Event()

    def holding(work):
        def held_work(*args, **kwargs):
            held.set()
            assert release.wait(60)
            return work(*args, **kwargs)
        return held_work

    app = tiny_app()
    tokenizer = app.state.alchemist.tokenizer
    if "structured_outputs" in body:
        monkeypatch.setattr(GrammarCompiler, "check", holding(GrammarCompiler.check))
    else:
        monkeypatch.setattr(tokenizer, "apply_chat_template", holding(tokenizer.apply_chat_template))
        monkeypatch.setattr(type(tokenizer), "__call__", holding(type(tokenizer).__call__))
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        answer = {}
        worker = threading.Thread(target=lambda: answer.update(r=client.post(route, json={"model": TINY_NAME, **body})))
        worker.start()
        assert held.wait(30)
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # while it is held (for 60 s)
        release.set()
        worker.join(60)
    assert answer["r"].status_code == 200, answer["r"].text
