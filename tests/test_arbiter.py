"""The arbiter's policies on a small model: idle-only training, slo interleaving with
back-off, served tokens untouched by training, merged weights rebuilt between steps, and
a clean stop on SIGTERM with a stream in flight."""

import asyncio
import json
import signal
import statistics
import time

import httpx
import pytest
import torch

from engine.async_engine import AsyncEngine
from trainer.config import ArbiterConfig, TrainConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import encode, make_config
from bench.launch import server_process
from tests.tiny import tiny_model, tiny_tokenizer
from trainer.adapter_store import AdapterStore
from server.build import build_training_engine
from trainer.arbiter import Arbiter
from trainer.online import OnlineTraining

LONG_PROMPT = ("Continuous batching lets new requests join the running batch at every step. " * 10).strip()


def trainer_with_backlog(entries: int = 20, entries_per_step: int = 1) -> tuple[LLMEngine, OnlineTraining]:
    engine, trainer = build_training_engine(
        tiny_model("llama", hidden_size=256, num_layers=6), tiny_tokenizer(),
        make_config(max_model_len=512, kv_cache_bytes=64 << 20, max_num_batched_tokens=512),
        TrainConfig(mode="cpt", lora_rank=4, entries_per_step=entries_per_step, cohort_max_entries=entries_per_step))
    ids = encode(LONG_PROMPT)
    for i in range(entries):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=1), train=True)
        while engine.has_unfinished():
            engine.step()
    return engine, trainer


async def serve_during(async_engine: AsyncEngine, request_id: str, params: SamplingParams) -> list[int]:
    tokens = []
    async for output in async_engine.generate(async_engine.make_request(request_id, encode("Hello, how are you?"),
                                                                        params)):
        tokens += output.outputs[0].token_ids
    return tokens


def run_with(engine: LLMEngine, trainer: OnlineTraining, config: ArbiterConfig, body):
    arbiter = Arbiter(trainer, config)
    async_engine = AsyncEngine(engine, idle_hook=arbiter)

    async def main():
        async_engine.start()
        try:
            return await body(async_engine)
        finally:
            await async_engine.stop()

    return asyncio.run(main()), arbiter


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


@pytest.mark.slow  # a backlog of 60 entries
def test_slo_policy_trains_between_decode_steps_and_leaves_served_tokens_unchanged():
    engine, trainer = trainer_with_backlog(entries=60, entries_per_step=60)  # one optimizer step at the very end
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    started = time.perf_counter()
    alone = engine.generate([encode("Hello, how are you?")], short)[0][0]
    token_s = (time.perf_counter() - started) / short.max_tokens
    while trainer.maintenance.warm_heap():  # the heap warmed first: the slices timed are the job's
        pass
    slice_s = statistics.median(_seconds(trainer.run_slice) for _ in range(10))
    # room for a few slices after each decode step, measured on this machine as it is now (a
    # fixed SLO fails on a loaded one), with the step's own time counted five times over (the
    # load may change after it was measured); the backlog (700 slices) outlasts the
    # request's five gaps even if the machine runs twenty times faster than when it was measured
    slo_ms = 1000 * (5 * token_s + 4 * slice_s)

    async def body(async_engine):
        while trainer.stats.slices < 15:
            await asyncio.sleep(0.001)
        return await serve_during(async_engine, "probe", short)

    served, arbiter = run_with(engine, trainer, ArbiterConfig(policy="slo", tpot_slo_ms=slo_ms), body)
    print(f"SLO {slo_ms:.1f} ms, {arbiter.stats.between_step_slices} slices between steps")
    assert arbiter.stats.between_step_slices > 0  # training progressed while the request decoded
    # the seconds of each kind, apart: only the idle ones are part of the engine's idle time
    assert arbiter.stats.between_step_slice_seconds > 0 and arbiter.stats.idle_slice_seconds > 0
    assert trainer.optimizer.version == 0  # the same adapter throughout the request...
    assert served == alone  # ...so the same tokens as serving alone


def test_idle_policy_never_trains_while_a_request_runs():
    engine, trainer = trainer_with_backlog(entries=10)

    async def body(async_engine):
        while trainer.stats.slices < 5:
            await asyncio.sleep(0.001)
        before = trainer.stats.slices
        task = asyncio.ensure_future(serve_during(async_engine, "probe", GREEDY))
        await asyncio.sleep(0)  # the request is queued; no slice may start until it is done
        during = []
        while not task.done():
            during.append(trainer.stats.slices)
            await asyncio.sleep(0.0005)
        await task
        return before, during

    (before, during), arbiter = run_with(engine, trainer, ArbiterConfig(policy="idle"), body)
    assert arbiter.stats.between_step_slices == 0
    assert max(during) <= before + 1  # at most the slice that was already running


def test_merged_weights_are_rebuilt_between_steps_of_a_request_under_the_idle_policy():
    """After an optimizer step the merged serving weights are stale. A request served
    before any idle gap must not decode on the slower unmerged path for its whole life:
    the rebuild runs between its steps, and the tokens stay those of this adapter."""
    from trainer.adapter import LeanLoraLinear

    engine, trainer = trainer_with_backlog(entries=1)
    trainer.train_until_idle(timeout_s=60)  # the optimizer step; its idle merge slices run here too
    assert trainer.optimizer.version == 1
    layers = [m for m in trainer.peft_model.modules() if isinstance(m, LeanLoraLinear)]
    with torch.no_grad():  # an optimizer step's effect, with the rebuild still to do
        for p in trainer.optimizer.params:
            p.add_(1e-3)
    trainer.maintenance.invalidate_merged()
    assert not any(layer.merged_is_current() for layer in layers)
    reference = engine.generate([encode("Hello, how are you?")], GREEDY)[0][0]  # lean and merged mixed
    assert not all(layer.merged_is_current() for layer in layers)

    async def body(async_engine):
        return await serve_during(async_engine, "probe", GREEDY)

    served, arbiter = run_with(engine, trainer, ArbiterConfig(policy="idle"), body)
    assert arbiter.stats.maintenance_slices > 0 and arbiter.stats.idle_slices == 0
    assert all(layer.merged_is_current() for layer in layers)
    assert served == reference


def test_slo_policy_backs_off_when_the_slo_cannot_be_met():
    engine, trainer = trainer_with_backlog(entries=10)

    async def body(async_engine):
        while trainer.stats.slices < 3:
            await asyncio.sleep(0.001)
        return await serve_during(async_engine, "probe", GREEDY)

    _, arbiter = run_with(engine, trainer, ArbiterConfig(policy="slo", tpot_slo_ms=0.01), body)
    assert arbiter.stats.between_step_slices == 0
    assert arbiter.stats.slo_backoffs > 0


@pytest.mark.slow
def test_sigterm_finishes_in_flight_streams_parks_training_and_saves_the_adapter(tmp_path):
    """SIGTERM while a stream is in flight and a training job runs: the stream gets all
    its tokens and [DONE], training stops at a slice boundary, the final adapter version
    is saved, and the process exits cleanly."""
    with server_process("--train-mode", "cpt", "--adapter-dir", str(tmp_path)) as (url, proc):
        httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 4,
            "messages": [{"role": "user", "content": LONG_PROMPT}]})
        # the tokens left after the signal must stream within uvicorn's graceful-shutdown
        # timeout (server/serve.py) on a loaded machine: a few, not dozens
        body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 12, "min_tokens": 12, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "Count slowly."}], "train": False}
        chunks, finish_reason, usage, done = 0, None, None, False
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    usage = chunk.get("usage") or usage
                    if chunk["choices"]:
                        finish_reason = chunk["choices"][0]["finish_reason"] or finish_reason
                        chunks += 1
                        if chunks == 3:
                            proc.send_signal(signal.SIGTERM)  # mid-stream, mid-training
        # every token, not a stream cut or aborted at shutdown (an abort ends with "stop")
        assert done and finish_reason == "length" and usage["completion_tokens"] == 12
        # uvicorn re-raises the signal after its graceful shutdown (exit status -SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)
        log = open(proc.log_path).read()
    assert "shutdown complete" in log
    # the adapter at shutdown is the newest saved version, and it loads
    last_saved = [int(line.split("saved adapter version ")[1].split()[0]) for line in log.splitlines()
                  if "saved adapter version " in line]
    saved = AdapterStore(tmp_path).versions()
    assert last_saved and saved[-1].version == last_saved[-1]
    AdapterStore(tmp_path).load(saved[-1].version)


def test_the_heap_is_warmed_between_serving_steps_when_no_idle_gap_comes():
    """Under steady traffic the trainer gets no idle gap, and the next recording would fault
    fresh pages in inside its prefill: a share of each step pre-faults them instead, while
    requests run, and the tokens are unchanged."""
    from engine.malloc_tuning import keep_freed_memory
    from tests.conftest import engine_of
    from tests.test_stash import make_trainer
    from tests.test_training import serve
    if not keep_freed_memory():
        pytest.skip("not glibc")
    trainer = make_trainer()
    warmer = trainer.maintenance.warmer
    serve(trainer, "recorded")  # sets the warm heap's target: the largest recording seen
    assert warmer.target > 0 and warmer.held_bytes == 0
    engine = engine_of(trainer)
    reference = engine.generate([encode("Hello, how are you?")], GREEDY)[0][0]
    trainer.cache.hold(trainer.cache.get("recorded"))  # no job, no idle item before the request

    async def body(async_engine):
        return await serve_during(async_engine, "probe", GREEDY)

    served, arbiter = run_with(engine, trainer, ArbiterConfig(policy="idle"), body)
    assert arbiter.stats.warming_slices > 0 and warmer.held_bytes > 0
    assert served == reference
