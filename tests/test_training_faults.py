"""An exception inside a training slice is logged and counted, its entries are dropped,
and serving and later training go on."""

import logging

from fastapi.testclient import TestClient

from trainer.config import TrainConfig
from tests.servers import TINY_NAME, tiny_app, wait_for


def test_a_failing_training_slice_drops_its_entry_and_serving_goes_on(caplog):
    with TestClient(tiny_app(train=TrainConfig(mode="cpt", lora_rank=4))) as client:
        trainer = client.app.state.alchemist.training
        real_job, calls = trainer.method.reuse_job, []

        def failing_once(entry, ctx):
            calls.append(entry.completion_id)
            if len(calls) == 1:
                yield  # one slice of work, then a fault
                raise RuntimeError("injected fault in a training slice")
            return (yield from real_job(entry, ctx))

        trainer.method.reuse_job = failing_once

        def serve(prompt):
            r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": prompt, "max_tokens": 4})
            assert r.status_code == 200, r.text
            return r.json()["id"]

        with caplog.at_level(logging.ERROR):
            first = serve("a prompt whose training fails")
            wait_for(lambda: trainer.stats.failed_jobs == 1)
        assert "injected fault" in caplog.text
        second = serve("a prompt that trains")
        wait_for(lambda: trainer.optimizer.version == 1)
        assert calls == [first, second]
        metrics = client.get("/metrics").text
        assert "alchemist:failed_train_jobs_total 1.0" in metrics
        assert 'alchemist:activation_cache_ended_entries_total{state="dropped"} 1.0' in metrics
        assert 'alchemist:activation_cache_ended_entries_total{state="trained"} 1.0' in metrics
        assert trainer.cache.bytes == 0 and len(trainer.cache) == 0
