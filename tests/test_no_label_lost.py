"""No label is lost: every request that can receive feedback keeps an entry whether or
not its activations could be kept (cache full, evicted, not drawn by record_fraction,
prompt too long), and its label trains by recomputation. Only the label timeout ends
such an entry; `"train": false` gets a clear 400; past `train.max_label_entries` the
refusal is counted and said, never silent. Real HTTP, tiny model."""

import asyncio

import httpx
import pytest

from tests.servers import TINY_NAME, ServerThread, tiny_app, wait_for
from trainer.config import TrainConfig

QUESTION = {"model": TINY_NAME, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer briefly."}]}


def metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return 0.0


async def concurrent_chats(url: str, count: int) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        responses = await asyncio.gather(*[client.post("/v1/chat/completions", json=QUESTION)
                                           for _ in range(count)])
    assert all(r.status_code == 200 for r in responses)
    return [r.json()["id"] for r in responses]


def one_token_of_recording() -> int:
    """A cache that holds one token's recording, so no prompt's (one that holds none is refused at start)."""
    import torch

    from tests.tiny import tiny_model
    from trainer.cache_budget import recorded_bytes_per_token
    return recorded_bytes_per_token(tiny_model("llama").config, torch.float32)


@pytest.mark.parametrize("train", [
    {"cache_bytes": "one token"},  # no recording ever fits
    {"record_fraction": 0.0},  # none drawn
    # every prompt too long to record (whole: a recording after a cached beginning may record one token)
    {"max_record_tokens": 1, "record_after_cached_prefix": False},
    {"cache_bytes": "one token", "cache_full_policy": "evict_oldest"},
], ids=["cache-full", "not-drawn", "too-long", "evict-oldest"])
def test_every_label_is_accepted_and_trained_when_activations_cannot_be_kept(train):
    if train.get("cache_bytes") == "one token":
        train = {**train, "cache_bytes": one_token_of_recording()}
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4, **train))
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        ids = asyncio.run(concurrent_chats(server.url, 6))
        wait_for(lambda: metric(client, "alchemist:label_entries") == 6)
        for completion in ids:
            r = client.post("/v1/feedback", json={"id": completion, "chosen": "Paris, of course."})
            assert r.status_code == 200, r.text
        wait_for(lambda: metric(client, 'alchemist:trained_entries_total{mode="dpo",path="recompute"}') == 6)
        assert metric(client, "alchemist:adapter_version") >= 2  # entries of one version may share a step
        assert metric(client, "alchemist:label_entries") == 0


def test_partly_full_cache_keeps_some_recordings_and_the_rest_as_label_entries():
    # the same question each time, each recording of the whole prompt (no cached beginning read)
    probe = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4, record_after_cached_prefix=False))
    with ServerThread(probe) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        client.post("/v1/chat/completions", json=QUESTION)
        size = metric(client, "alchemist:activation_cache_bytes")
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4, cache_bytes=int(size * 2.5),
                                     record_after_cached_prefix=False))
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        ids = [client.post("/v1/chat/completions", json=QUESTION).json()["id"] for _ in range(5)]
        assert metric(client, "alchemist:label_entries") == 3
        for completion in ids:
            assert client.post("/v1/feedback", json={"id": completion, "chosen": "Paris."}).status_code == 200
        def trained_by_path():
            return {path: metric(client, f'alchemist:trained_entries_total{{mode="dpo",path="{path}"}}')
                    for path in ("reuse", "stashed", "recompute")}

        wait_for(lambda: sum(trained_by_path().values()) == 5)
        trained = trained_by_path()
        assert trained["recompute"] >= 3 and sum(trained.values()) == 5, trained
        assert metric(client, "alchemist:trained_entry_staleness_count") == 5


def test_feedback_for_a_request_served_without_training_is_a_clear_400():
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4))
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        completion = client.post("/v1/chat/completions", json={**QUESTION, "train": False}).json()["id"]
        r = client.post("/v1/feedback", json={"id": completion, "chosen": "Paris."})
        assert r.status_code == 400 and r.json()["error"]["code"] == "not_trainable", r.text
        assert r.json()["error"]["param"] == "id" and '"train": false' in r.json()["error"]["message"]
        r = client.post("/v1/feedback", json={"id": "chatcmpl-never-served", "chosen": "Paris."})
        assert r.status_code == 404


def test_label_entries_past_the_bound_are_refused_counted_and_explained():
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4, cache_bytes=one_token_of_recording(),
                                     max_label_entries=2))
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        ids = [client.post("/v1/chat/completions", json=QUESTION).json()["id"] for _ in range(3)]
        assert metric(client, "alchemist:label_entries") == 2
        assert metric(client, "alchemist:refused_label_entries_total") == 1
        r = client.post("/v1/feedback", json={"id": ids[2], "chosen": "Paris."})
        assert r.status_code == 404 and "max_label_entries" in r.json()["error"]["message"], r.text
        assert client.post("/v1/feedback", json={"id": ids[0], "chosen": "Paris."}).status_code == 200
